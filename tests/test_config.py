"""Engine configuration: the shipped TOML files load, and bad settings name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxinfer.config import EngineConfig, ModelConfig, load_engine_config
from jaxinfer.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("engine-*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_engine_configs_load(path):
    cfg = load_engine_config(path)
    assert isinstance(cfg, EngineConfig) and cfg.token_buckets == tuple(sorted(cfg.token_buckets))


def test_overrides_apply_over_the_file():
    cfg = load_engine_config(CONFIGS[0], max_seqs=3, page_size=None)
    assert cfg.max_seqs == 3 and cfg.page_size == load_engine_config(CONFIGS[0]).page_size


@pytest.mark.parametrize(("changes", "field"), [
    ({"page_size": 0}, "page_size"), ({"num_pages": 1}, "num_pages"), ({"token_buckets": (8, 4)}, "token_buckets"),
    ({"compile_guard": "loud"}, "compile_guard"), ({"dtype": "int8"}, "dtype"), ({"bogus": 1}, "bogus"),
    ({"attention_backend": "ragged_reference"}, "max_model_len to at most 4096, got the model default"),
    ({"attention_backend": "ragged_reference", "max_model_len": 8192}, "max_model_len to at most 4096, got 8192"),
    ({"kv_host_pages": -1}, "kv_host_pages must be 0 \\(off\\) or positive, got -1"),
    ({"kv_store_max_bytes": -5}, "kv_store_max_bytes"),
    ({"kv_store_ttl_seconds": float("nan")}, "kv_store_ttl_seconds"),
    ({"kv_store_sweep_seconds": -1.0}, "kv_store_sweep_seconds"),
    ({"kv_store_timeout_seconds": 0.0}, "kv_store_timeout_seconds must be positive and finite, got 0.0"),
    ({"kv_store_timeout_seconds": float("inf")}, "kv_store_timeout_seconds"),
])
def test_bad_engine_settings_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig().replace(**changes)


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_engine_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_engine_config(tmp_path / "none.toml")


def test_page_table_width_tiles_the_attention_blocks():
    model = ModelConfig(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=1000)
    cfg = EngineConfig(page_size=16, attention_block_tokens=128)
    assert cfg.resolved_max_model_len(model) == 1000
    assert cfg.max_pages_per_seq(model) % 8 == 0 and cfg.max_pages_per_seq(model) * 16 >= 1000


SERVE_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("serve-*.toml"))


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_shipped_serve_configs_load(path):
    from serving.server import check_role, load_configs

    serve, engine = load_configs(path)
    check_role(serve, engine)
    assert serve.model and serve.port > 0


@pytest.mark.parametrize("value", [0, -3, True, "64", 2.5])
def test_serve_max_queued_must_be_a_positive_whole_number(tmp_path, value):
    from serving.server import load_configs

    path = tmp_path / "serve.toml"
    path.write_text(f"[serve]\nmax_queued = {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=r"serve\.max_queued must be a whole number >= 1"):
        load_configs(path)


def test_deploy_manifests_use_the_engine_s_names_and_ports():
    """The GKE manifests name the environment variables the code reads and the ports the config serves."""
    import yaml

    from jaxinfer.parallel import distributed, lockstep
    from serving.server import load_configs

    repo = Path(__file__).resolve().parents[1]
    known = {distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
             lockstep.ENV_CONTROL_PORT, lockstep.ENV_CONTROL_HOST}
    manifests = sorted((repo / "configs" / "deploy").glob("*.yaml"))
    assert manifests
    for path in manifests:
        workload, service = yaml.safe_load_all(path.read_text())
        text = yaml.safe_dump(workload)
        pods = [workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]] if "leaderWorkerTemplate" in text \
            else [workload["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]]
        for pod in pods:
            container = pod["containers"][0]
            names = {e["name"] for e in container.get("env", [])}
            assert names <= known, (path.name, names - known)
            command = container["command"]
            serve, _ = load_configs(repo / command[command.index("--config") + 1])
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["grpc"] == serve.port and ports["metrics"] == serve.metrics_port, path.name
            assert ports["control"] == int(next(e["value"] for e in container["env"]
                                               if e["name"] == lockstep.ENV_CONTROL_PORT)), path.name
        assert {p["targetPort"] for p in service["spec"]["ports"]} == {serve.port, serve.metrics_port}, path.name
