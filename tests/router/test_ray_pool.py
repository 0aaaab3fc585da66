"""RayPool, the pool control API's launcher under Ray (router/ray_launch.py), against a
fake `ray` module: spawn names and engine options, a drained worker's actor ended for good
and its exit reported, a worker that exits unasked left to Ray to restart, `stop` off the
router's loop (tests/deploy/test_ray.py runs the real cluster)."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import types

import pytest

from common.config import EngineOptions
from router import ray_launch
from router.config import RouterConfig
from router.deploy import RayPlacement, plan_deployment
from router.ray_launch import RayLauncher, RayPool
from router.registry import PoolError


class RayError(Exception):
    pass


class Ref:
    """A call's result: ready with a value or an error, or never answered (`pending`)."""

    def __init__(self, value=None, error: Exception | None = None, pending: bool = False) -> None:
        self.value, self.error, self.pending = value, error, pending


class FakeActor:
    def __init__(self, ray: "FakeRay", name: str, options: dict, args: tuple) -> None:
        self.ray, self.name, self.options, self.spec = ray, name, options, args[0]
        self.code: int | None = None  # the worker's exit code once it exited
        self.answers = True
        self.exit_code = types.SimpleNamespace(remote=self._exit_code)
        self.stop = types.SimpleNamespace(remote=self._stop)
        self.asked = 0

    def _exit_code(self) -> Ref:
        self.asked += 1
        return Ref(self.code) if self.answers else Ref(pending=True)

    def _stop(self, timeout: float) -> Ref:
        self.code = 0 if self.code is None else self.code
        return Ref(self.code)


class FakeRay:
    """The part of `ray` that RayLauncher and RayPool use."""

    def __init__(self) -> None:
        self.actors: dict[str, FakeActor] = {}
        self.kills: list[tuple[str, bool]] = []
        self.exceptions = types.SimpleNamespace(RayError=RayError, GetTimeoutError=RayError, RayActorError=RayError)
        self.util = types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")

    def remote(self, cls):
        ray = self

        class ActorClass:
            @staticmethod
            def options(name: str, namespace: str, **options):
                def remote(*args):
                    if name in ray.actors:
                        raise ValueError(f"actor name {name!r} is taken")
                    ray.actors[name] = FakeActor(ray, name, options, args)
                    return ray.actors[name]
                return types.SimpleNamespace(remote=remote)
        return ActorClass

    def wait(self, refs, num_returns, timeout):
        return [r for r in refs if not r.pending], [r for r in refs if r.pending]

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, actor: FakeActor, no_restart: bool) -> None:
        self.kills.append((actor.name, no_restart))
        if no_restart:
            del self.actors[actor.name]
        else:
            actor.code = None  # restarted: a new worker

    def get_actor(self, name: str, namespace: str) -> FakeActor:
        if name not in self.actors:
            raise ValueError(f"no actor {name}")
        return self.actors[name]


class FakeControl:
    def __init__(self) -> None:
        self.letting_go: set[str] = set()
        self.exits: list[tuple[str, int | None]] = []

    def leaving(self, worker_id: str) -> bool:
        return worker_id in self.letting_go

    def worker_exited(self, worker_id: str, code: int | None) -> bool:
        self.exits.append((worker_id, code))
        return True


@pytest.fixture
def pool(monkeypatch):
    ray = FakeRay()
    monkeypatch.setattr(ray_launch, "import_ray", lambda: ray)
    options = EngineOptions.of(dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=128)
    dep = plan_deployment(RouterConfig(model_dir="m", max_model_len=128), options, kv_transfer="tcp",
                          prefill_devices=("cpu",), decode_devices=("cpu",))
    dep = dataclasses.replace(dep, ray=RayPlacement("auto", {"prefill": {"prefill_pool": 1.0}}, "/s"))
    launcher = RayLauncher(dep, "tcp://127.0.0.1:5000")
    for spec in dep.workers:
        launcher._start(spec)
    control = FakeControl()
    return RayPool(launcher, stop_timeout_s=1.0).watching(control), ray, control


def tick(pool: RayPool) -> None:
    asyncio.run(pool.tick())


def test_spawn_places_by_role_names_workers_and_takes_engine_options(pool):
    pool, ray, _ = pool
    assert pool.owns("prefill-0") and pool.owns("decode-0") and not pool.owns("prefill-1")
    assert pool.spawn("prefill") == "prefill-1"
    actor = ray.actors["prefill-1"]
    assert actor.options["resources"] == {"prefill_pool": 1.0} and actor.options["max_restarts"] == -1
    assert actor.spec["worker"]["role"] == "prefill" and actor.spec["worker"]["worker_id"] == "prefill-1"
    assert pool.spawn("decode", "prefill-0-as-d", {"num_kv_blocks": 32}) == "prefill-0-as-d"
    assert ray.actors["prefill-0-as-d"].spec["engine"]["num_kv_blocks"] == 32
    assert pool.owns("prefill-1") and pool.owns("prefill-0-as-d")
    for role, worker_id, engine, why in (("colocated", "", None, "no colocated workers"),
                                         ("prefill", "", {"num_kv_blocks": -3}, "num_kv_blocks"),
                                         ("prefill", "", {"no_such_option": 1}, "no_such_option")):
        with pytest.raises(PoolError, match=why):
            pool.spawn(role, worker_id, engine)
    assert set(ray.actors) == {"prefill-0", "decode-0", "prefill-1", "prefill-0-as-d"}  # refusals start nothing


def test_a_drained_worker_has_its_actor_ended_for_good_and_its_exit_reported(pool):
    pool, ray, control = pool
    pool.spawn("prefill")
    tick(pool)
    assert control.exits == [] and ray.kills == []  # every worker runs
    ray.actors["prefill-1"].code = 0
    control.letting_go.add("prefill-1")
    tick(pool)
    assert ray.kills == [("prefill-1", True)] and control.exits == [("prefill-1", 0)]
    assert [h.name for h in pool.launcher.workers] == ["prefill-0", "decode-0"]
    assert pool.owns("prefill-1")  # shown as a worker it started, among the departed
    assert pool.spawn("decode", "prefill-1") == "prefill-1"  # a role change restarts it under its name
    tick(pool)
    assert control.exits == [("prefill-1", 0)]


def test_a_worker_that_exits_unasked_is_restarted_by_ray(pool):
    pool, ray, control = pool
    ray.actors["decode-0"].code = 0
    tick(pool)
    assert ray.kills == [("decode-0", False)] and control.exits == []
    assert "decode-0" in ray.actors and pool._handle("decode-0") is not None


def test_an_actor_that_does_not_answer_is_asked_once_until_it_does(pool):
    pool, ray, control = pool
    actor = ray.actors["prefill-0"]
    actor.answers = False
    for _ in range(3):
        tick(pool)
    assert actor.asked == 1 and control.exits == []
    pool._polls["prefill-0"] = (pool._handle("prefill-0"), Ref(error=RayError("actor died")))  # it restarted
    tick(pool)
    assert control.exits == [] and ray.kills == []


def test_stop_runs_off_the_loop_and_its_exit_is_reported(pool):
    pool, ray, control = pool
    pool.stop("prefill-0")
    pool.stop("prefill-0")  # asked twice: stopped once
    pool.stop("nobody")
    for t in [t for t in threading.enumerate() if t.name == "stop-prefill-0"]:
        t.join(5)
    tick(pool)
    assert ray.kills == [("prefill-0", True)] and control.exits == [("prefill-0", 0)]
    assert [h.name for h in pool.launcher.workers] == ["decode-0"]
