"""`--planner-latency-models auto` (router/deploy/latency_auto.py): `serve` profiles its own
engine on this host at the planner's two thread counts, once, and reads the cache after;
a changed model or engine is profiled again; a failed profile is a clear error that leaves
nothing in the cache; Ray deployments and joined workers are refused. One real run of
`pdserve profile --engine-json` on a tiny model checks the command line the cache is made by."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from pdserve.common.config import ConfigError
from pdserve.common.worker.spec import WorkerSpec
from pdserve.router.deploy import latency_auto
from pdserve.router.deploy.local import planner_models
from pdserve.router.core.config import RouterConfig
from pdserve.router.launch.deployment import DeploymentConfig


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "latency_models"


def fake_profiles(monkeypatch) -> list[dict]:
    """subprocess.run as `pdserve profile` would answer: a latency model whose meta names the
    threads of the engine JSON it was given. Returns the calls, each its engine options."""
    calls = []

    def run(cmd, **kw):
        engine = json.loads(Path(cmd[cmd.index("--engine-json") + 1]).read_text())
        calls.append(engine)
        model = {"schema": "pdserve-latency-model/1", "meta": {"num_threads": engine["num_threads"]},
                 "prefill": {"points": [[16, 0.01], [256, 0.1]]},
                 "decode": {"base_s": 0.005, "per_seq_s": 0.0005, "per_token_s": 1e-6, "samples": []},
                 "transfer": {"points": [[1, 0.0001], [8, 0.001]]}}
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(model))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(latency_auto.subprocess, "run", run)
    return calls


def spec(model_dir: str, **options) -> WorkerSpec:
    return WorkerSpec.of(model_dir, "colocated", "colocated-0", num_threads=2, **options)


def test_profiled_once_per_model_engine_and_machine_then_read_from_the_cache(tmp_path, cache, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    calls = fake_profiles(monkeypatch)
    paths = latency_auto.profiled_models(spec(str(model)), 2, log=lambda _: None).split(",")
    assert [c["num_threads"] for c in calls] == [2, 1] and all(c["dtype"] == "auto" or c["dtype"] for c in calls)
    assert [Path(p).parent for p in paths] == [cache, cache] and paths[0].endswith("-t2.json")
    assert sorted(p.name for p in cache.iterdir()) == sorted(Path(p).name for p in paths)  # no temp file left
    assert latency_auto.profiled_models(spec(str(model)), 2, log=lambda _: None).split(",") == paths
    assert len(calls) == 2  # the cache answered
    latency_auto.profiled_models(spec(str(model), block_size=32), 2, log=lambda _: None)
    assert len(calls) == 4  # another engine: profiled again
    time.sleep(0.01)
    (model / "config.json").write_text("{ }")  # the model changed
    latency_auto.profiled_models(spec(str(model)), 2, log=lambda _: None)
    assert len(calls) == 6


def test_a_failed_profile_is_a_clear_error_and_caches_nothing(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(latency_auto.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ConfigError: no such dtype"))
    with pytest.raises(ConfigError, match="no such dtype"):
        latency_auto.profiled_models(spec(str(tmp_path)), 2, log=lambda _: None)
    assert list(cache.iterdir()) == []
    with pytest.raises(ConfigError, match="host-cores >= 2"):
        latency_auto.profiled_models(spec(str(tmp_path)), 1, log=lambda _: None)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_CACHE", str(blocker))  # a file where the cache folder should go
    with pytest.raises(ConfigError, match="PDSERVE_CACHE"):
        latency_auto.profiled_models(spec(str(tmp_path)), 2, log=lambda _: None)


def test_serve_takes_auto_only_for_its_own_workers_on_this_host(tmp_path, cache, monkeypatch):
    fake_profiles(monkeypatch)
    config = RouterConfig(str(tmp_path), planner="slo", slo_ttft_ms=500, slo_tpot_ms=50, planner_host_cores=2,
                          planner_latency_models="auto")
    dep = DeploymentConfig(config, (spec(str(tmp_path)),))
    models = planner_models(config, dep)
    assert models.colocated.meta["num_threads"] == 2 and models.split.meta["num_threads"] == 1
    with pytest.raises(ConfigError, match="under Ray"):
        planner_models(config, None)
    with pytest.raises(ConfigError, match="planner_host_cores"):
        RouterConfig(str(tmp_path), planner="slo", slo_ttft_ms=500, slo_tpot_ms=50, planner_latency_models="auto")


def test_the_profile_command_line_it_runs_on_a_tiny_model(model_dirs, cache):
    """No fakes: `pdserve profile --engine-json` in a child process, as serve runs it."""
    s = WorkerSpec.of(model_dirs["qwen3"], "colocated", "colocated-0", num_threads=2, max_model_len=256)
    t0 = time.monotonic()
    paths = latency_auto.profiled_models(s, 2, "shm", log=lambda _: None).split(",")
    models = [json.loads(Path(p).read_text()) for p in paths]
    assert [m["meta"]["num_threads"] for m in models] == [2, 1]
    assert all(m["meta"]["kv_transfer"] == "shm" and os.path.samefile(m["meta"]["model"], model_dirs["qwen3"])
               for m in models)
    assert time.monotonic() - t0 < 300
