"""The deployment plan `pdserve serve` fills once (router/launch/deployment.py): one WorkerSpec per
worker, consistent with the router's config."""
from __future__ import annotations

import dataclasses

import pytest

from pdserve.common.config import ConfigError, EngineOptions
from pdserve.router.core.config import RouterConfig
from pdserve.router.launch.deployment import DeploymentConfig, plan_deployment

ROUTER = RouterConfig(model_dir="/models/m", http_port=0, zmq_port=0)


def test_pd_plan_gives_each_worker_its_device_and_gloo_ranks():
    dep = plan_deployment(ROUTER, EngineOptions.of(num_kv_blocks=64), prefill_devices=("cpu",),
                          decode_devices=("cpu", "cpu"), kv_transfer="gloo", threads_per_worker=1)
    assert [w.worker.worker_id for w in dep.workers] == ["prefill-0", "decode-0", "decode-1"]
    assert [w.worker.rank for w in dep.workers] == [0, 1, 2]
    assert {w.worker.world_size for w in dep.workers} == {3} and len({w.worker.dist_init for w in dep.workers}) == 1
    assert all(w.engine.cache.num_kv_blocks == 64 and w.engine.device.num_threads == 1 for w in dep.workers)
    assert (dep.prefill_devices, dep.decode_devices, dep.colocated_devices) == (("cpu",), ("cpu", "cpu"), ())


def test_colocated_plan_and_auto_backend():
    dep = plan_deployment(ROUTER, EngineOptions(), colocated_devices=("cpu", "cpu"))
    assert [w.worker.role for w in dep.workers] == ["colocated", "colocated"] and dep.kv_transfer == ""
    assert plan_deployment(ROUTER, EngineOptions(), prefill_devices=("cpu",), decode_devices=("cpu",)).kv_transfer == "shm"


def test_workers_must_share_the_routers_block_size_and_model():
    dep = plan_deployment(ROUTER, EngineOptions(), prefill_devices=("cpu",), decode_devices=("cpu",))
    with pytest.raises(ConfigError, match="block_size"):
        DeploymentConfig(ROUTER, (dataclasses.replace(dep.workers[0], engine=EngineOptions.of(block_size=32)),))
    with pytest.raises(ConfigError, match="serves"):
        DeploymentConfig(ROUTER, (dataclasses.replace(dep.workers[0], model_dir="/models/other"),))


def test_nccl_plan_refuses_two_workers_on_one_gpu():
    """NCCL refuses two ranks on one device: the plan says so before anything starts."""
    with pytest.raises(ConfigError, match=r"one GPU per worker.*cuda:0.*cuda_ipc"):
        plan_deployment(ROUTER, EngineOptions(), prefill_devices=("cuda:0",), decode_devices=("cuda",), kv_transfer="nccl")
    dep = plan_deployment(ROUTER, EngineOptions(), prefill_devices=("cuda:0",), decode_devices=("cuda:1",),
                          kv_transfer="nccl")
    assert dep.kv_transfer == "nccl" and [w.worker.rank for w in dep.workers] == [0, 1]
    # cuda_ipc shares a GPU between P and D
    assert plan_deployment(ROUTER, EngineOptions(), prefill_devices=("cuda:0",), decode_devices=("cuda:0",),
                           kv_transfer="cuda_ipc").kv_transfer == "cuda_ipc"
