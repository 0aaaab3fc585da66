"""Elastic pools: the registry's drain state machine (serving -> draining -> exiting ->
retired) in ManualClock time, and the router's control API (router/pools/control.py) in-process
against fake workers: drains wait for in-flight requests, refusals change nothing, a
client without the secret gets no answer, a launcher's workers are started and restarted
in a new role."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from pdserve.common.clock import ManualClock
from pdserve.common.wire import messages
from pdserve.common.wire.auth import new_secret
from pdserve.common.wire.messages import GenerateRequest, RequestOutput, WorkerDrain
from pdserve.router.pools.control import ControlPlane
from pdserve.router.pools.client import ControlClient, ControlError, format_pools
from pdserve.router.core.registry import DRAINING, EXITING, SERVING, PoolError, WorkerRegistry
from tests.support.router_harness import Harness, collect, run, step, submit
from tests.support.router_harness import hello


# ---- the registry's state machine -------------------------------------------------------------

def _pd_registry(clock: ManualClock) -> WorkerRegistry:
    reg = WorkerRegistry(stale_after_s=3.0, retire_memory_s=30.0)
    for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        reg.hello(hello(wid, role), clock.monotonic())
    return reg


def test_drained_worker_leaves_rotation_then_exits_once_its_requests_are_done():
    clock = ManualClock()
    reg = _pd_registry(clock)
    d1 = reg.workers["d1"]
    d1.take()  # one request routed to it
    reg.drain(reg.serving_entry("d1"), clock.monotonic())
    assert d1.state == DRAINING and {e.worker_id for e in reg.live(("decode",))} == {"d0"}
    clock.advance(1.0)
    assert reg.ready_to_exit(clock.monotonic()) == []  # its request is still running
    d1.inflight -= 1
    assert reg.ready_to_exit(clock.monotonic()) == [d1] and d1.state == EXITING and d1.state_since == 1.0
    assert reg.ready_to_exit(clock.monotonic()) == []  # told once
    clock.advance(10.0)  # silent (it exited): not a death
    reg.heartbeat(messages.WorkerStatus("p0", "prefill", 0, 0, 64, 64), clock.monotonic())
    reg.heartbeat(messages.WorkerStatus("d0", "decode", 0, 0, 64, 64), clock.monotonic())
    assert reg.expire(clock.monotonic()) == []
    assert reg.exited_silently(clock.monotonic()) == [d1]
    reg.retire(d1, clock.monotonic())
    assert "d1" not in reg.workers and reg.pool_counts() == {("prefill", SERVING): 1, ("decode", SERVING): 1}


def test_a_retired_workers_late_hello_is_ignored_but_a_new_process_registers():
    clock = ManualClock()
    reg = _pd_registry(clock)
    old = reg.workers["d1"].hello
    reg.retire(reg.workers["d1"], clock.monotonic())
    assert reg.ignores(old, clock.monotonic()) and reg.hello(old, clock.monotonic()) is None
    assert "d1" not in reg.workers
    fresh = dataclasses.replace(old, address="tcp://127.0.0.1:7999")  # restarted: a new address
    assert reg.hello(fresh, clock.monotonic()).state == SERVING
    clock.advance(31.0)
    reg.retire(reg.workers["d1"], clock.monotonic() - 31.0)  # remembered until 30 s after retiring
    assert reg.hello(fresh, clock.monotonic()) is not None


def test_a_draining_worker_that_dies_is_a_death_its_requests_are_rerouted():
    clock = ManualClock()
    reg = _pd_registry(clock)
    d1 = reg.workers["d1"]
    d1.take()
    reg.drain(d1, clock.monotonic())
    clock.advance(4.0)
    assert d1 in reg.expire(clock.monotonic())  # draining, silent: dead (router re-routes its requests)
    assert reg.ready_to_exit(clock.monotonic()) == []


def test_serving_entry_and_can_serve_without_say_what_is_wrong():
    clock = ManualClock()
    reg = _pd_registry(clock)
    with pytest.raises(PoolError, match=r"no worker 'd9' is registered \(workers: d0, d1, p0\)"):
        reg.serving_entry("d9")
    reg.drain(reg.serving_entry("d1"), 0.0)
    with pytest.raises(PoolError, match="worker d1 is draining, not serving"):
        reg.serving_entry("d1")
    assert not reg.can_serve_without([reg.workers["d0"]])  # the last serving decode worker
    assert not reg.can_serve_without([reg.workers["p0"]])
    reg.hello(hello("c0", "colocated"), 0.0)
    assert reg.can_serve_without([reg.workers["d0"], reg.workers["p0"]])  # c0 still serves


# ---- the control API, in-process -----------------------------------------------------------------

class FakeLauncher:
    """A WorkerLauncher that records what it was asked (no processes)."""

    def __init__(self) -> None:
        self.spawned: list[tuple[str, str, str]] = []
        self.stopped: list[str] = []
        self.names: set[str] = set()

    def spawn(self, role: str, worker_id: str = "", engine: dict | None = None) -> str:
        wid = worker_id or f"{role}-new{len(self.spawned)}"
        self.spawned.append((role, engine, wid))
        self.names.add(wid)
        return wid

    def stop(self, worker_id: str) -> None:
        self.stopped.append(worker_id)

    def owns(self, worker_id: str) -> bool:
        return worker_id in self.names


async def _call(client: ControlClient, method: str, *args):
    return await asyncio.to_thread(getattr(client, method), *args)


async def _states(client: ControlClient) -> dict[str, str]:
    return {w.worker_id: w.state for w in await _call(client, "pools")}


async def _wait_drain_message(w, timeout_s: float = 5.0) -> bool:
    got = await w.next_request(timeout_s)
    return got is not None and isinstance(got[1], WorkerDrain)


async def _heartbeats(h: Harness, ids: set[str]) -> None:
    """Fake workers' heartbeats every 0.1 s for as long as their ids are in `ids`."""
    while True:
        for wid in list(ids):
            await h.send(messages.WorkerStatus(wid, "colocated", 0, 0, 64, 64))
        await asyncio.sleep(0.1)


def test_drain_waits_for_the_inflight_request_then_tells_the_worker_to_exit(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"], stale_after_s=1.0)
        plane = ControlPlane(h.router, None, "pdserve worker --role {role} --join X")
        plane.start()
        client = ControlClient(h.router.control_address, h.router.secret, timeout_s=5)
        beating = {"c0", "c1"}
        beats = asyncio.create_task(_heartbeats(h, beating))
        try:
            c0 = await h.registered("c0")
            c1 = h.worker("c1")
            await h.send(c1.hello())
            while len(h.router.registry.live(("colocated",))) < 2:
                await asyncio.sleep(0.01)
            h.router.registry.workers["c0"].inflight = 100  # the load policy picks c1 for the request
            job = asyncio.create_task(collect(h.router, submit("r1")))
            identity, req = await c1.next_request()
            assert isinstance(req, GenerateRequest)
            h.router.registry.workers["c0"].inflight = 0
            reply = await _call(client, "drain", "c1")
            assert reply.worker_ids == ["c1"] and "draining c1" in reply.message
            assert (await _states(client))["c1"] == "draining"
            job2 = asyncio.create_task(collect(h.router, submit("r2")))  # goes to c0 only
            _, req2 = await c0.next_request()
            assert req2.request_id == "r2"
            assert await c1.next_request(timeout_s=0.3) is None  # no exit while r1 runs
            await c1.reply(identity, step(RequestOutput("r1", [5], finished=True, finish_reason="length")))
            assert (await job)[-1].finished  # the drained worker's request completed
            assert await _wait_drain_message(c1)
            beating.discard("c1")  # it exits
            assert (await _states(client))["c1"] == "exiting"
            while (await _states(client))["c1"] == "exiting":  # silent past stale_after_s: it left
                await asyncio.sleep(0.1)
            pools = await _call(client, "pools")
            assert [(w.worker_id, w.state) for w in pools] == [("c0", "serving"), ("c1", "exited")]
            assert "c1" not in h.router.worker_socks and "c0" in format_pools(pools)
            await h.send(c1.hello())  # its keepalive's late hello: not registered again
            await asyncio.sleep(0.2)
            assert "c1" not in h.router.registry.workers
            job2.cancel()
            await asyncio.gather(job2, return_exceptions=True)
        finally:
            beats.cancel()
            client.close()
            plane.close()
            await h.close()

    run(scenario())


def test_bad_requests_are_refused_and_change_nothing(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        plane = ControlPlane(h.router, None, "pdserve worker --role {role} --join tcp://R:1 --secret-file F M")
        plane.start()
        client = ControlClient(h.router.control_address, h.router.secret, timeout_s=5)
        try:
            await h.registered("c0")
            before = await _states(client)
            cases = [("drain", ("c9",), r"no worker 'c9' is registered \(workers: c0\)"),
                     ("scale", ("colocated", -2), "cannot remove 2 colocated worker.s.: the colocated pool has 1"),
                     ("scale", ("colocated", -1), "refused to drain c0: no worker left could serve"),
                     ("drain", ("c0",), "refused to drain c0: no worker left could serve"),
                     ("scale", ("decoder", 1), "unknown role 'decoder'"),
                     ("scale", ("prefill", 1), "accepts whoever joins. Start a prefill worker on any host with: "
                                               "pdserve worker --role prefill --join tcp://R:1"),
                     ("change_role", ("c0", "decode"), "c0 joined on its own: the router cannot restart it"),
                     ("change_role", ("c0", "colocated"), "already a colocated worker")]
            for method, args, why in cases:
                with pytest.raises(ControlError, match=why):
                    await _call(client, method, *args)
            assert await _states(client) == before == {"c0": "serving"}
            # no secret, or another deployment's: no answer at all, nothing changes
            for secret in (new_secret(),):
                stranger = ControlClient(h.router.control_address, secret, timeout_s=0.5)
                with pytest.raises(ControlError, match="no answer from the router"):
                    await _call(stranger, "drain", "c0")
                stranger.close()
            await h.report.send(messages.encode(messages.DrainWorker("c0")))  # unsigned
            await asyncio.sleep(0.2)
            assert h.router.registry.workers["c0"].state == SERVING
        finally:
            client.close()
            plane.close()
            await h.close()

    run(scenario())


def test_launcher_grows_a_pool_and_restarts_a_worker_in_its_new_role(model_dirs):
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        launcher = FakeLauncher()
        plane = ControlPlane(h.router, launcher)
        plane.start()
        client = ControlClient(h.router.control_address, h.router.secret, timeout_s=5)
        try:
            await h.registered("c0")
            reply = await _call(client, "scale", "colocated", 1, {"num_threads": 2})
            (wid,) = reply.worker_ids
            assert reply.can_spawn and launcher.spawned == [("colocated", {"num_threads": 2}, wid)]
            assert (await _states(client))[wid] == "starting"
            new = h.worker(wid)
            await h.send(new.hello())  # it registers on its own, as a started process does
            while (await _states(client))[wid] != "serving":
                await asyncio.sleep(0.02)
            assert {e.worker_id for e in h.router.registry.live(("colocated",))} == {"c0", wid}
            reply = await _call(client, "change_role", wid, "prefill", {"num_threads": 1})
            assert "restarts as a prefill worker" in reply.message
            assert await _wait_drain_message(new)  # nothing was routed to it: told at once
            assert plane.leaving(wid) and plane.worker_exited(wid, 0)  # the launcher saw it exit 0
            assert launcher.spawned[-1] == ("prefill", {"device": "cpu", "num_threads": 1}, wid)  # same id and device
            pools = {w.worker_id: w for w in await _call(client, "pools")}
            assert (pools[wid].state, pools[wid].role) == ("starting", "prefill")
            with pytest.raises(ControlError, match="refused to drain c0"):  # a lone prefill worker cannot serve
                await _call(client, "drain", "c0")
        finally:
            client.close()
            plane.close()
            await h.close()

    run(scenario())


def test_a_prefill_worker_is_drained_after_its_handoff_and_told_on_its_own_socket(model_dirs):
    """The router has no socket to a prefill worker: the exit goes over a one-off
    connection, once the request it prefills has its first token."""
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        plane = ControlPlane(h.router)
        plane.start()
        client = ControlClient(h.router.control_address, h.router.secret, timeout_s=5)
        try:
            await h.registered("c0")
            d0 = h.worker("d0")
            p0 = h.worker("p0")
            await h.send(dataclasses.replace(d0.hello(), role="decode"))
            await h.send(dataclasses.replace(p0.hello(), role="prefill"))
            while len(h.router.registry.live(("prefill", "decode"))) < 2:
                await asyncio.sleep(0.01)
            job = asyncio.create_task(collect(h.router, submit("r1")))
            identity, req = await d0.next_request()  # P/D pairs are preferred: d0 serves it through p0
            assert req.prefill_addr == p0.address
            with pytest.raises(ControlError, match="unknown role 'x'"):
                await _call(client, "change_role", "p0", "x")
            await _call(client, "scale", "prefill", -1)
            assert await p0.next_request(timeout_s=0.3) is None  # its hand-off is pending
            await d0.reply(identity, step(RequestOutput("r1", [5])))  # the first token: P's part is over
            assert await _wait_drain_message(p0)
            await d0.reply(identity, step(RequestOutput("r1", [6], finished=True, finish_reason="length")))
            assert (await job)[-1].finished
            assert plane.leaving("p0") and not plane.leaving("c0")
        finally:
            client.close()
            plane.close()
            await h.close()

    run(scenario())


def test_local_launcher_refuses_fixed_groups_and_bad_engine_options(model_dirs, tmp_path):
    from pdserve.common.config import EngineOptions
    from pdserve.router.core.config import RouterConfig
    from pdserve.router.launch.deployment import plan_deployment
    from pdserve.router.launch.local import Launcher
    from pdserve.router.pools.launch import LocalLauncher
    router = RouterConfig(model_dir=model_dirs["qwen3"])
    gloo = plan_deployment(router, EngineOptions.of(), prefill_devices=("cpu",), decode_devices=("cpu",),
                           kv_transfer="gloo")
    launcher = Launcher(tmp_path)
    with pytest.raises(PoolError, match="kv transfer is gloo: its group is fixed at start"):
        LocalLauncher(launcher, gloo, "tcp://127.0.0.1:1").spawn("prefill")
    shm = plan_deployment(router, EngineOptions.of(), prefill_devices=("cpu",), decode_devices=("cpu",))
    with pytest.raises(PoolError, match="engine options {'num_threads': -1}"):
        LocalLauncher(launcher, shm, "tcp://127.0.0.1:1").spawn("decode", "", {"num_threads": -1})
    assert launcher.workers == []  # nothing started


def test_an_exiting_worker_that_keeps_running_is_stopped_by_its_launcher(model_dirs):
    """ManualClock time: told to exit, still heartbeating EXIT_GRACE_S later -> stop()."""
    from pdserve.router.pools.control import EXIT_GRACE_S

    async def scenario():
        clock = ManualClock()
        h = Harness(model_dirs["qwen3"], stale_after_s=5.0, clock=clock)
        launcher = FakeLauncher()
        launcher.names.add("c1")
        plane = ControlPlane(h.router, launcher)  # not started: the test turns its crank
        try:
            for w in (h.worker("c0"), c1 := h.worker("c1")):
                await h.send(w.hello())
            while len(h.router.registry.workers) < 2:  # not wait_for_workers: it sleeps on the ManualClock
                await asyncio.sleep(0.01)
            plane.drain(["c1"])
            await plane.tick()
            assert await _wait_drain_message(c1) and h.router.registry.workers["c1"].state == EXITING
            for _ in range(3):  # past the grace on the 2nd and 3rd turn: stopped once
                clock.now += EXIT_GRACE_S / 2 + 1
                for wid in ("c0", "c1"):  # both still heartbeat
                    h.router.registry.heartbeat(messages.WorkerStatus(wid, "colocated", 0, 0, 64, 64), clock.now)
                await plane.tick()
            assert launcher.stopped == ["c1"]
            assert plane.worker_exited("c1", -15) and plane.departed["c1"].exit_code == -15
            assert [w.state for w in plane.pools()] == ["serving", "exited"]
        finally:
            await h.close()

    run(scenario())


def test_a_worker_its_launcher_gave_up_on_shows_failed_with_the_reason(model_dirs):
    from pdserve.router.openai.server import OpenAIServer

    async def scenario():
        h = Harness(model_dirs["qwen3"])
        plane = ControlPlane(h.router, FakeLauncher())
        try:
            await h.registered("c0")
            (wid,) = plane.grow("prefill", 1).worker_ids
            assert not plane.registered(wid) and plane.registered("c0")
            plane.worker_failed(wid, "prefill", "exited with code 2 before registering, 3 times in a row")
            (failed,) = [w for w in plane.pools() if w.worker_id == wid]
            assert (failed.state, failed.reason) == ("failed", "exited with code 2 before registering, 3 times in a row")
            assert "exited with code 2 before registering" in format_pools(plane.pools())
            health = json.loads((await OpenAIServer(h.router).health()).body)
            assert health["failed"] == [wid] and health["status"] == "ok"  # c0 serves on
            assert health["pools"][wid] == {"role": "prefill", "state": "failed", "reason": failed.reason}
            plane.grow("prefill", 1)  # another worker's start leaves it shown
            assert wid in h.router.failed
            plane._starting(wid, "prefill")  # a start under its id (a role change's restart) clears it
            assert wid not in h.router.failed
            assert {w.worker_id: w.state for w in plane.pools()}[wid] == "starting"
        finally:
            await h.close()

    run(scenario())
