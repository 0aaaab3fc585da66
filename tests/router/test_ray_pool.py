"""RayPool, the pool control API's launcher under Ray (router/pools/ray_pool.py), against a fake
`ray` module (tests/support/fake_ray.py): spawn names and engine options, a drained worker's
actor ended for good and its exit reported, a worker that exits unasked left to Ray to
restart, `stop` off the router's loop, and bounded starts: a worker that keeps failing
before it registers, whose actor cannot be created, or that never registers, is ended for
good and reported failed. A restarted router adopts the running worker actors by name and
finishes the drains of the router it replaces (tests/deploy/test_ray.py runs the real
cluster)."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import types

import pytest

from pdserve.common.config import EngineOptions
from pdserve.router.launch import ray as ray_launch
from pdserve.router.core.config import RouterConfig
from pdserve.router.launch.deployment import DeploymentConfig, RayPlacement, plan_deployment
from pdserve.router.launch.ray import ROUTER_ACTOR, RayLauncher, next_index
from pdserve.router.pools.ray_pool import RayPool
from pdserve.router.core.registry import PoolError
from tests.support.fake_ray import ActorInitError, FakeActor, FakeControl, FakeRay, RayError, Ref

CONTROL = "tcp://127.0.0.1:5000"


@pytest.fixture
def ray(monkeypatch) -> FakeRay:
    ray = FakeRay()
    monkeypatch.setattr(ray_launch, "import_ray", lambda: ray)
    return ray


@pytest.fixture
def dep() -> DeploymentConfig:
    options = EngineOptions.of(dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=128)
    dep = plan_deployment(RouterConfig(model_dir="m", max_model_len=128), options, kv_transfer="tcp",
                          prefill_devices=("cpu",), decode_devices=("cpu",))
    return dataclasses.replace(dep, ray=RayPlacement("auto", {"prefill": {"prefill_pool": 1.0}}, "/s"))


@pytest.fixture
def pool(ray, dep):
    launcher = RayLauncher(dep, CONTROL)
    launcher.start_all()
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


def test_a_worker_that_keeps_exiting_before_it_registers_is_failed_and_its_actor_ended(pool):
    pool, ray, control = pool
    control.joined.add("decode-0")
    for n in range(1, 3):  # failed starts below the bound: Ray starts it again each time
        ray.actors["prefill-0"].code = 2
        tick(pool)
        assert ray.kills == [("prefill-0", False)] * n and control.failed == []
    ray.actors["prefill-0"].code = 2
    tick(pool)  # the third in a row: given up
    assert ray.kills[-1] == ("prefill-0", True) and "prefill-0" not in ray.actors
    ((wid, role, why),) = control.failed
    assert (wid, role) == ("prefill-0", "prefill") and "exited with code 2 before registering, 3 times" in why
    assert [h.name for h in pool.launcher.workers] == ["decode-0"] and control.exits == []
    tick(pool)
    assert len(control.failed) == 1  # reported once


def test_registering_resets_the_count_and_a_registered_workers_failure_is_always_restarted(pool):
    pool, ray, control = pool
    for _ in range(2):
        ray.actors["prefill-0"].code = 2
        tick(pool)
    control.joined.add("prefill-0")
    tick(pool)  # it registered: its count starts again
    ray.actors["prefill-0"].code = 9  # a registered worker crashes: restarted, not counted
    tick(pool)
    control.joined.discard("prefill-0")  # the router found it dead
    for _ in range(2):
        ray.actors["prefill-0"].code = 2
        tick(pool)
    assert control.failed == [] and ray.kills == [("prefill-0", False)] * 5


def test_an_actor_whose_creation_failed_is_reported_failed_with_its_reason(pool):
    pool, ray, control = pool
    pool.spawn("prefill")
    actor = ray.actors["prefill-1"]
    error = ActorInitError("The actor died because of an error raised in its creation task\nTraceback ...\n"
                           "WorkerStartError: worker prefill-1 exited with code 2 before it was ready")
    actor.exit_code = types.SimpleNamespace(remote=lambda: Ref(error=error))
    tick(pool)
    assert control.failed == [("prefill-1", "prefill", "WorkerStartError: worker prefill-1 exited with code 2 "
                                                       "before it was ready")]
    assert ray.kills == [("prefill-1", True)] and pool._handle("prefill-1") is None
    pool._polls["prefill-0"] = (pool._handle("prefill-0"), Ref(error=RayError("actor died")))  # a node was lost
    tick(pool)
    assert len(control.failed) == 1  # that one Ray restarts


def test_a_worker_never_registered_within_the_start_timeout_is_failed(pool, monkeypatch):
    pool, ray, control = pool
    now = [1000.0]
    monkeypatch.setattr(ray_launch.time, "monotonic", lambda: now[0])
    control.joined.add("decode-0")
    tick(pool)
    now[0] += pool.start_timeout_s
    tick(pool)
    assert control.failed == []
    now[0] += 1
    tick(pool)
    ((wid, _, why),) = control.failed
    assert wid == "prefill-0" and f"not registered within {pool.start_timeout_s:.0f} s" in why
    assert "prefill_pool" in why and ray.kills == [("prefill-0", True)]


def test_a_restarted_router_adopts_the_running_worker_actors_by_name(pool, dep):
    pool, ray, _ = pool
    pool.spawn("prefill")
    pool.spawn("decode", "prefill-0-as-d")
    ray.actors[ROUTER_ACTOR] = FakeActor(ray, ROUTER_ACTOR, "pdserve", {}, (dep,))  # the router's own: not a worker
    ray.actors["prefill-7"] = FakeActor(ray, "prefill-7", "another-deployment", {}, ({"worker": {"role": "prefill"}},))
    before = dict(ray.actors)
    adopting = RayLauncher(dep, CONTROL, adopt=True)
    adopting.start_all()
    assert {h.name: h.role for h in adopting.workers} == {"decode-0": "decode", "prefill-0": "prefill",
                                                          "prefill-0-as-d": "decode", "prefill-1": "prefill"}
    assert all(h.adopted and h.info["worker_id"] == h.name for h in adopting.workers)
    assert ray.actors == before and ray.kills == []  # nothing started, nothing ended
    assert adopting.spawn("prefill").name == "prefill-2"  # its numbers go on after the names taken
    assert adopting.spawn("decode").name == "decode-1"


def test_an_actor_that_died_for_good_while_the_router_was_down_is_not_adopted(ray, dep):
    RayLauncher(dep, CONTROL).start_all()
    ray.actors["prefill-0"].info_error = ActorInitError("its worker exited before it was ready")
    adopting = RayLauncher(dep, CONTROL, adopt=True)
    adopting.start_all()
    assert [h.name for h in adopting.workers] == ["decode-0"] and ray.kills == [("prefill-0", True)]


def test_a_restarted_router_finishes_the_drains_of_the_one_it_replaces(pool, dep):
    first, ray, _ = pool
    first.spawn("prefill")
    first.spawn("prefill")
    ray.actors["prefill-1"].stopping = True  # its `stop` was under way when the router died
    ray.actors["prefill-2"].code = 0  # told to drain by the router that died; it exited meanwhile
    adopting = RayLauncher(dep, CONTROL, adopt=True)
    adopting.start_all()
    control = FakeControl()
    control.joined |= {"prefill-0", "decode-0"}
    pool = RayPool(adopting, stop_timeout_s=1.0).watching(control)
    tick(pool)
    for t in [t for t in threading.enumerate() if t.name == "stop-prefill-1"]:
        t.join(5)
    tick(pool)
    assert sorted(ray.kills) == [("prefill-1", True), ("prefill-2", True)]
    assert sorted(control.exits) == [("prefill-1", 0), ("prefill-2", 0)]
    assert sorted(h.name for h in adopting.workers) == ["decode-0", "prefill-0"]
    ray.actors["decode-0"].code = 0  # registered with this router, then exited unasked: restarted
    tick(pool)
    assert ray.kills[-1] == ("decode-0", False) and control.failed == []


def test_next_index_goes_past_the_names_taken():
    assert next_index("prefill", ["prefill-0", "prefill-3", "decode-9", "prefill-x", "prefill-0-as-d"], 1) == 4
    assert next_index("decode", ["prefill-0"], 2) == 2
