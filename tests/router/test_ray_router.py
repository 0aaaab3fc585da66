"""The router as a detached Ray actor (router/deploy/ray_router.py), without a Ray cluster: where
it is placed and the fixed address it comes back at after a restart, the actor's start,
failure and stop around a stand-in `serve`, and ending a deployment (every actor named in
its namespace, no other). tests/deploy/test_ray.py kills the real router actor."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import types

import pytest

from pdserve.common.config import ConfigError, EngineOptions
from pdserve.router.launch import ray as ray_launch
from pdserve.router.deploy import ray_router
from pdserve.router.core.config import RouterConfig
from pdserve.router.launch.deployment import DeploymentConfig, RayPlacement, plan_deployment
from pdserve.router.launch.local import LaunchError
from pdserve.router.launch.ray import ROUTER_ACTOR
from pdserve.router.deploy.ray_router import RouterActor, end_deployment, fixed_address, router_options, serve_on_ray, start_router
from tests.support.fake_ray import FakeActor, FakeRay


@pytest.fixture
def ray(monkeypatch) -> FakeRay:
    ray = FakeRay()
    monkeypatch.setattr(ray_launch, "import_ray", lambda: ray)
    monkeypatch.setattr(ray_router, "import_ray", lambda: ray)
    return ray


@pytest.fixture
def dep(tmp_path) -> DeploymentConfig:
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    options = EngineOptions.of(dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=128)
    router = RouterConfig(model_dir="m", max_model_len=128, http_port=0, zmq_port=6001, control_port=0)
    dep = plan_deployment(router, options, kv_transfer="tcp", prefill_devices=("cpu",), decode_devices=("cpu",))
    return dataclasses.replace(dep, secret="ab" * 32, ray=RayPlacement("auto", {"router": {}}, str(secret), "ns"))


def test_the_router_is_placed_on_the_head_node_unless_its_resources_say_otherwise():
    assert router_options({}) == {"num_cpus": 0.0, "num_gpus": 0.0, "resources": {"node:__internal_head__": 0.001}}
    assert router_options({"router_node": 1.0, "CPU": 2.0, "memory": 1e9}) == {
        "num_cpus": 2.0, "num_gpus": 0.0, "memory": 1e9, "resources": {"router_node": 1.0}}


def test_ports_given_as_zero_are_fixed_once_and_given_ones_kept():
    config = RouterConfig(model_dir="m", http_port=0, zmq_port=6001, control_port=0)
    fixed = fixed_address(config, "10.0.0.5", [7001, 7002, 7003])
    assert (fixed.host, fixed.zmq_port, fixed.control_port, fixed.http_port) == ("10.0.0.5", 6001, 7001, 7002)
    off = fixed_address(dataclasses.replace(config, enable_http=False), "10.0.0.5", [7001, 7002, 7003])
    assert (off.control_port, off.http_port) == (7001, 0)  # no HTTP: no port taken for it


def test_start_router_pins_the_actor_to_the_probed_node_at_fixed_ports_without_the_secret(ray, dep):
    ray.task_result = ("node-a", "10.0.0.5", [7001, 7002, 7003])
    actor = start_router(ray, dep, bind_node_address=True)
    ((task, probe_options, (count,)),) = ray.tasks
    assert task == "probe" and count == 3 and probe_options["resources"] == {"node:__internal_head__": 0.001}
    assert actor is ray.actors[ROUTER_ACTOR] and actor.namespace == "ns"
    o = actor.options
    assert (o["lifetime"], o["max_restarts"], o["scheduling_strategy"]) == ("detached", -1, ("node", "node-a", False))
    sent: DeploymentConfig = actor.spec  # what Ray gives the actor at every (re)start
    assert sent.secret == "" and sent.ray == dep.ray and sent.workers == dep.workers
    r = sent.router
    assert (r.host, r.zmq_port, r.control_port, r.http_port) == ("10.0.0.5", 6001, 7001, 7002)
    ray.actors.clear()
    kept = start_router(ray, dataclasses.replace(dep, router=dataclasses.replace(dep.router, host="0.0.0.0")),
                        bind_node_address=False)
    assert kept.spec.router.host == "0.0.0.0"  # a --host given wins


def test_ending_a_deployment_stops_its_router_then_ends_every_actor_named_in_its_namespace(ray, dep):
    router = ray.actors[ROUTER_ACTOR] = FakeActor(ray, ROUTER_ACTOR, "ns", {}, (dep,))
    for name, namespace in (("prefill-0", "ns"), ("decode-0", "ns"), ("prefill-0-other", "other")):
        ray.actors[name] = FakeActor(ray, name, namespace, {}, ({"worker": {"role": "prefill"}},))
    assert end_deployment(ray, "ns") == ["decode-0", ROUTER_ACTOR, "prefill-0"]
    assert router.stopping  # it drained its workers first
    assert list(ray.actors) == ["prefill-0-other"] and all(no_restart for _, no_restart in ray.kills)
    assert end_deployment(ray, "ns") == []


def test_serve_refuses_a_namespace_that_holds_a_deployment(ray, dep, monkeypatch):
    monkeypatch.setattr(ray_router, "connect", lambda placement: "127.0.0.1")
    ray.actors["prefill-0"] = FakeActor(ray, "prefill-0", "ns", {}, ({"worker": {"role": "prefill"}},))
    with pytest.raises(ConfigError, match="pdserve ray-stop --ray auto --ray-namespace ns"):
        serve_on_ray(dep)
    assert list(ray.actors) == ["prefill-0"] and ray.tasks == [] and ray.shutdowns == 1


class _FakeRayRuntime:
    """`ray` as seen inside an actor: its node, and whether Ray restarted it."""

    def __init__(self, restarted: bool) -> None:
        context = types.SimpleNamespace(was_current_actor_reconstructed=restarted, get_node_id=lambda: "node-a")
        self.get_runtime_context = lambda: context


def _actor(monkeypatch, dep, restarted: bool, fake_serve) -> RouterActor:
    monkeypatch.setitem(__import__("sys").modules, "ray", _FakeRayRuntime(restarted))
    monkeypatch.setattr(ray_router, "serve", fake_serve)
    return RouterActor(dataclasses.replace(dep, secret=""))


def test_the_router_actor_serves_reads_the_secret_on_its_node_and_stops(monkeypatch, dep):
    seen = {}

    async def fake_serve(d, *, stop, on_ready, adopt):
        seen.update(secret=d.secret, adopt=adopt)
        on_ready({"http": "http://10.0.0.5:7002/v1"})
        await stop.wait()
        seen["stopped"] = True

    actor = _actor(monkeypatch, dep, True, fake_serve)
    info = actor.ready(5)
    assert info["http"] == "http://10.0.0.5:7002/v1"
    assert info["router"] == {"node_id": "node-a", "pid": os.getpid(), "restarted": True}
    assert seen == {"secret": "ab" * 32, "adopt": True}  # a restarted router adopts the workers
    assert actor.stop(5) and seen["stopped"]


def test_the_router_actor_is_a_threaded_actor():
    # a coroutine method would make it an asyncio actor: a blocking `ready` would hold up `stop`
    assert not [name for name, f in vars(RouterActor).items() if inspect.iscoroutinefunction(f)]


def test_a_first_start_that_fails_is_told_to_the_driver(monkeypatch, dep):
    async def fake_serve(d, *, stop, on_ready, adopt):
        raise ConfigError("cannot bind tcp://10.0.0.5:6001")

    actor = _actor(monkeypatch, dep, False, fake_serve)
    with pytest.raises(LaunchError, match="ConfigError: cannot bind"):
        actor.ready(5)


def test_a_restarted_router_that_cannot_serve_exits_for_ray_to_start_it_again(monkeypatch, dep):
    exits = []
    monkeypatch.setattr(ray_router, "RESTART_PAUSE_S", 0.0)
    monkeypatch.setattr(ray_router.os, "_exit", exits.append)

    async def fake_serve(d, *, stop, on_ready, adopt):
        await asyncio.sleep(0)
        raise OSError("address in use")

    actor = _actor(monkeypatch, dep, True, fake_serve)
    with pytest.raises(LaunchError, match="address in use"):
        actor.ready(5)
    actor._thread.join(5)
    assert exits == [1]


def test_the_router_actor_needs_the_secret_file_on_its_node(monkeypatch, dep):
    missing = dataclasses.replace(dep, ray=dataclasses.replace(dep.ray, secret_file="/no/such/secret"))
    with pytest.raises(ConfigError, match="on the router's node"):
        _actor(monkeypatch, missing, False, None)


def test_ray_stop_ends_a_deployment_whose_driver_died(ray, dep, monkeypatch, capsys):
    from pdserve.router.cli.main import main
    placed = []
    monkeypatch.setattr(ray_router, "connect", placed.append)
    ray.actors[ROUTER_ACTOR] = FakeActor(ray, ROUTER_ACTOR, "ns", {}, (dep,))
    ray.actors["decode-0"] = FakeActor(ray, "decode-0", "ns", {}, ({"worker": {"role": "decode"}},))
    assert main(["ray-stop", "--ray", "10.0.0.1:6379", "--ray-namespace", "ns"]) == 0
    assert (placed[0].address, placed[0].namespace) == ("10.0.0.1:6379", "ns") and ray.actors == {}
    assert f"ended decode-0, {ROUTER_ACTOR}" in capsys.readouterr().out and ray.shutdowns == 1
    assert main(["ray-stop", "--ray", "auto", "--ray-namespace", "ns"]) == 0
    assert "no actors in Ray namespace 'ns'" in capsys.readouterr().out
