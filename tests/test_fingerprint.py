"""Checkpoint fingerprints (weights/fingerprint.py): equal for the same files anywhere, different when
the weights differ, and the group check that names what differs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.errors import CheckpointError
from jaxinfer.weights.fingerprint import SAMPLE_BYTES, check_same_as_leader, fingerprint, load_fingerprints
from jaxinfer.weights.registry import resolve


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
    assert fingerprint(copy) == fingerprint(original)
    assert fingerprint(copy / "model.safetensors") == fingerprint(original / "model.safetensors")


@pytest.mark.parametrize("change", ["first byte", "last byte", "renamed", "extra file", "config"])
def test_other_weights_have_another_fingerprint(tmp_path, change):
    folder = checkpoint_folder(tmp_path / "a")
    before = fingerprint(folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if change in ("first byte", "last byte"):
        assert len(data) > SAMPLE_BYTES * 8  # sampled, not read whole: the end is a sample of its own
        data[0 if change == "first byte" else -1] ^= 0xFF
        weights.write_bytes(bytes(data))
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

