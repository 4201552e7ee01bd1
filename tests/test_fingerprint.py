"""Checkpoint fingerprints (weights/fingerprint.py): equal for the same files anywhere, different when
any byte of the weights differs, cached by each file's identity, and the group check that names
what differs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.errors import CheckpointError
from jaxinfer.weights.fingerprint import ENV_CACHE, check_same_as_leader, fingerprint, load_fingerprints
from jaxinfer.weights.registry import resolve


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "fingerprint-cache"
    monkeypatch.setenv(ENV_CACHE, str(cache))
    return cache


def checkpoint_folder(root: Path, seed: int = 0) -> Path:
    """A folder shaped like a Hugging Face checkpoint: a config, a 1 MiB weights file, and the
    cache and notes a download leaves next to them."""
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 64}')
    (root / "model.safetensors").write_bytes(np.random.default_rng(seed).bytes(1 << 20))
    (root / ".cache").mkdir()
    (root / ".cache" / "download.lock").write_text("lock")
    (root / "README.md").write_text("notes")
    return root


def test_the_same_files_elsewhere_have_the_same_fingerprint(tmp_path):
    original = checkpoint_folder(tmp_path / "a")
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(original, copy)
    os.utime(copy / "model.safetensors", (0, 0))  # another modification time
    (copy / ".cache" / "download.lock").write_text("another lock")  # caches and notes are not the model
    (copy / "README.md").write_text("other notes")
    (copy / "original").mkdir()  # another framework's copy of the weights, which no loader here reads
    (copy / "original" / "consolidated.00.pth").write_bytes(b"\1" * 64)
    assert fingerprint(copy) == fingerprint(original)
    (copy / "model.safetensors").rename(copy / "renamed.safetensors")  # a single file: its name is not hashed
    assert fingerprint(copy / "renamed.safetensors") == fingerprint(original / "model.safetensors")


@pytest.mark.parametrize("change", ["first byte", "middle byte", "last byte", "renamed", "extra file", "config",
                                    "linked folder"])
def test_other_weights_have_another_fingerprint(tmp_path, change):
    folder = checkpoint_folder(tmp_path / "a")
    before = fingerprint(folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if change.endswith("byte"):
        data[{"first byte": 0, "middle byte": 300_001, "last byte": -1}[change]] ^= 0xFF
        stat = weights.stat()
        weights.write_bytes(bytes(data))
        # A rewrite within the clock's tick may keep the modification time; a real edit moves it.
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    elif change == "linked folder":  # a symlinked folder's files count like the folder's own
        (tmp_path / "shards").mkdir()
        (tmp_path / "shards" / "part.safetensors").write_bytes(b"\0" * 16)
        (folder / "shards").symlink_to(tmp_path / "shards")
    elif change == "renamed":
        weights.rename(folder / "model-00001-of-00001.safetensors")
    elif change == "extra file":
        (folder / "adapter.safetensors").write_bytes(b"\0" * 16)
    else:
        (folder / "config.json").write_text('{"hidden_size": 65}')
    assert fingerprint(folder) != before


def test_a_registry_name_and_its_path_load_the_same():
    by_name = load_fingerprints("smollm2-135m")
    by_path = load_fingerprints(resolve("smollm2-135m").path)
    assert by_name["model"]["fingerprint"] == by_path["model"]["fingerprint"]
    assert set(by_name) == {"model"}
    with pytest.raises(CheckpointError, match="unknown model 'no-such-model'"):
        load_fingerprints("smollm2-135m", draft_model="no-such-model")


def test_a_follower_with_other_checkpoints_is_refused_with_both_named(tmp_path):
    leader = {"model": {"name": "/models/a", "fingerprint": "aaaa"}}
    check_same_as_leader(leader, {"model": {"name": "a-copy", "fingerprint": "aaaa"}}, process_id=1)  # names differ
    with pytest.raises(CheckpointError, match=r"model: process 3 reads 'b' \(fingerprint bbbb\), other files than "
                                              r"the leader's \(process 0\) '/models/a' \(fingerprint aaaa\)"):
        check_same_as_leader(leader, {"model": {"name": "b", "fingerprint": "bbbb"}}, process_id=3)
    with pytest.raises(CheckpointError, match=r"draft_model: the leader \(process 0\) loads none, process 1 'd'"):
        check_same_as_leader(leader, {**leader, "draft_model": {"name": "d", "fingerprint": "dddd"}}, process_id=1)



def test_each_file_is_hashed_once_until_it_changes(tmp_path, cache_dir, monkeypatch):
    """The cache keys a file's digest by its path, inode, size and modification time: a rewritten file
    is hashed again, and an edit that restores size and time by hand is not seen (the documented
    limit, shown here to prove the cache is read)."""
    folder = checkpoint_folder(tmp_path / "a")
    weights = folder / "model.safetensors"
    first = fingerprint(folder)
    assert len(list(cache_dir.iterdir())) == 2  # config.json and the weights; no temporary left behind
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[5] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(folder) == first  # from the cache
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = fingerprint(folder)
    assert changed != first
    monkeypatch.setenv(ENV_CACHE, "off")
    assert fingerprint(folder) == changed


def test_nothing_to_hash_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("no weights here")
    with pytest.raises(CheckpointError, match="holds no checkpoint files"):
        fingerprint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="cannot be read for its fingerprint"):
        fingerprint(tmp_path / "missing")
