"""A worker's config as data (common/worker/spec.py): the JSON file the launcher writes
round-trips, and as input it is validated, each error naming the field."""
from __future__ import annotations

import json
import stat

import pytest

from pdserve.common.config import ConfigError, EngineOptions, WorkerConfig
from pdserve.common.worker.spec import WorkerSpec, worker_main


def spec() -> WorkerSpec:
    return WorkerSpec.of("/models/m", "decode", "decode-0", num_kv_blocks=64, max_model_len=256, num_threads=1,
                         kv_transfer="shm", prefill_peers=("tcp://127.0.0.1:5000",), peer_timeout_s=2.0)


def test_file_round_trips_and_is_private(tmp_path):
    path = spec().write(tmp_path / "w.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    back = WorkerSpec.read(path)
    assert back == spec()
    assert back.engine == EngineOptions.of(num_kv_blocks=64, max_model_len=256, num_threads=1)
    assert back.worker.prefill_peers == ("tcp://127.0.0.1:5000",) and back.worker.peer_timeout_s == 2.0


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["engine"].update(block_size="16"), ["block_size", "int"]),
    (lambda d: d["engine"].update(num_kv_blocks=True), ["num_kv_blocks"]),
    (lambda d: d["engine"].update(bogus=1), ["bogus"]),
    (lambda d: d["worker"].update(role="router"), ["role"]),
    (lambda d: d["worker"].update(kv_transfer="carrier-pigeon"), ["kv_transfer"]),
    (lambda d: d["worker"].update(prefill_peers="tcp://x:1"), ["prefill_peers", "list"]),
    (lambda d: d["worker"].pop("worker_id"), ["worker_id"]),
    (lambda d: d.update(version=2), ["version"]),
    (lambda d: d.update(model_dir=""), ["model_dir"]),
])
def test_bad_field_is_a_config_error_naming_it(edit, words):
    data = json.loads(json.dumps(spec().to_dict()))
    edit(data)
    with pytest.raises(ConfigError) as e:
        WorkerSpec.from_dict(data)
    for word in words:
        assert word in str(e.value)


def test_unknown_flat_option_is_refused():
    with pytest.raises(ConfigError, match="peer_timeout"):
        WorkerSpec.of("/m", "prefill", "p0", peer_timeout=2.0)


def test_worker_main_exits_2_on_a_bad_file_without_serving(tmp_path, capsys):
    served = []
    path = tmp_path / "w.json"
    path.write_text("{not json")
    assert worker_main(["--config", str(path)], "python -m pdserve.decode_node", ("decode",),
                       lambda e, w: served.append(w)) == 2
    assert "not valid JSON" in capsys.readouterr().err and not served
    spec().write(path)  # a decode config given to the prefill entry point
    assert worker_main(["--config", str(path)], "python -m pdserve.prefill_node", ("prefill",),
                       lambda e, w: served.append(w)) == 2
    assert "'decode'" in capsys.readouterr().err and not served


def test_worker_config_round_trips():
    w = WorkerConfig(role="prefill", worker_id="p0", kv_transfer="gloo", dist_init="tcp://127.0.0.1:1", rank=0,
                     world_size=2)
    assert WorkerConfig.from_dict(json.loads(json.dumps(w.to_dict()))) == w


@pytest.mark.parametrize("role, device, asked, expected", [
    ("decode", "cpu", False, False),  # no graph to replay on the CPU: padding would only add rows
    ("colocated", "cpu", False, False),
    ("decode", "cpu", True, True),  # asked for (tests of the bucketing)
    ("decode", "cuda:0", False, True),
    ("colocated", "cuda:0", False, True),
    ("prefill", "cuda:0", False, False),
])
def test_graph_runner_only_where_it_replays_graphs(tmp_path, monkeypatch, role, device, asked, expected):
    import torch

    from pdserve.common.loading.model_factory import make_model
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the choice is logic: no GPU needed
    model = make_model(tmp_path / "m", "qwen3", "tiny", seed=0)
    s = WorkerSpec.of(str(model), role, f"{role}-0", num_kv_blocks=64, max_model_len=256, device=device,
                      decode_graphs=asked)
    assert s.engine_config().decode_graphs is expected
