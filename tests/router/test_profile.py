"""`pdserve profile` (router/cli/profile.py) on a tiny model: it writes a latency model file
with the sizes asked for, which the router's cost mode loads; bad plans are refused."""
from __future__ import annotations

import json

import pytest

from pdserve.common.config import ConfigError, EngineOptions
from pdserve.router.cli.main import main
from pdserve.router.core.config import RouterConfig
from pdserve.router.core.disagg_policy import DisaggCase
from pdserve.router.core.disagg_state import policy_from_config
from pdserve.common.latency_model import SCHEMA, LatencyModel
from pdserve.common.worker.spec import role_engine
from pdserve.router.cli.profile import ProfilePlan, run_profile
from tests.support.helpers import one_torch_thread


def test_profile_command_writes_a_model_the_cost_mode_loads(model_dirs, tmp_path, capsys):
    out = tmp_path / "lm.json"
    with one_torch_thread():
        rc = main(["profile", model_dirs["qwen3"], "--out", str(out), "--num-threads", "1", "--kv-transfer", "shm",
                   "--prefill-tokens", "8,40,100", "--batches", "1,3", "--contexts", "20,60", "--blocks", "1,4",
                   "--decode-steps", "2", "--reps", "1", "--max-model-len", "128"])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["schema"] == SCHEMA and data["meta"]["kv_transfer"] == "shm" and data["meta"]["num_threads"] == 1
    assert [n for n, _ in data["prefill"]["points"]] == [8, 40, 100]
    assert [n for n, _ in data["transfer"]["points"]] == [1, 4]
    assert [(b, c) for b, c, _ in data["decode"]["samples"]] == [(1, 22.0), (1, 62.0), (3, 22.0), (3, 62.0)]
    assert all(s > 0 for _, s in data["prefill"]["points"] + data["transfer"]["points"])
    model = LatencyModel.load(out)
    assert model.decode_step_s(4, 50.0) > 0 and model.decode_step_s(0, 50.0) == 0.0
    policy = policy_from_config(RouterConfig(model_dir=model_dirs["qwen3"], disagg="cost",
                                             disagg_latency_model=str(out)))
    choice = policy.decide(DisaggCase(50, 50, 50, 4, 0, 0, 2, 30.0))
    assert choice.reason == "cost" and choice.ttft_via_prefill_s > 0 and choice.ttft_on_decode_s > 0


def test_profile_tcp_transfer_and_refused_plans(model_dirs):
    options = EngineOptions.of(num_threads=1, max_model_len=64)
    with one_torch_thread():
        model = run_profile(model_dirs["llama"], options, ProfilePlan((8, 30), (2,), (16,), (1, 3), 1, 1), "tcp")
    assert model.meta["kv_transfer"] == "tcp" and [n for n, _ in model.transfer.points] == [1, 3]
    with pytest.raises(ConfigError, match="2 prefill sizes"):
        run_profile(model_dirs["llama"], options, ProfilePlan((63, 64, 100), (2,), (16,), (1, 3)))  # one size: 63
    with pytest.raises(ConfigError, match="not 'gloo'"):
        run_profile(model_dirs["llama"], options, ProfilePlan((8, 30), (2,), (16,), (1, 3), 1, 1), "gloo")


def test_gpu_decode_steps_are_profiled_as_decode_workers_take_them():
    """Through CUDA graphs on a GPU, as common/worker/spec.py gives decode workers there
    (run_profile asks role_engine for a decode worker's options); on the CPU as asked
    (eager unless --decode-graphs)."""
    assert role_engine(EngineOptions.of(device="cuda:0"), "decode").decode_graphs
    assert role_engine(EngineOptions.of(device="cuda"), "decode").decode_graphs
    assert not role_engine(EngineOptions.of(device="cuda:0"), "prefill").decode_graphs
    assert not role_engine(EngineOptions.of(device="cpu"), "decode").decode_graphs
    assert role_engine(EngineOptions.of(device="cpu", decode_graphs=True), "decode").decode_graphs
