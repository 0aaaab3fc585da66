"""The router's control socket against processes that are not the deployment's workers:
a forged hello (no tag, another secret) and a replayed one are refused and logged; a
validly signed hello with a bad endpoint is refused; no message stops the control loop,
and a real worker still registers and is served afterwards."""
from __future__ import annotations

import asyncio
import dataclasses

from pdserve.common.wire import messages
from pdserve.common.wire.auth import DeploymentKey, new_secret
from pdserve.common.wire.transport import Authenticator
from tests.support.router_harness import Harness, collect, submit


def run(coro):
    asyncio.run(coro)


def test_forged_replayed_and_bad_hellos_are_refused(model_dirs, capfd):
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            thief = h.worker("c-thief")  # wants other users' prompts
            good = h.worker("c-good")
            await h.report.send(messages.encode(thief.hello()))  # no tag at all
            await h.report.send(Authenticator(DeploymentKey(new_secret()), "x").seal(thief.hello()))  # other secret
            for bad in ("not an endpoint", "tcp://127.0.0.1:99999", "inproc://router-internal", "tcp://:0", ""):
                await h.send(dataclasses.replace(good.hello(), worker_id=f"c-bad-{len(bad)}", address=bad))
            captured = h.auth.seal(good.hello())
            await h.report.send(captured)
            await h.router.wait_for_workers(0, 0, 1, timeout=5)
            await h.report.send(captured)  # the same frame again, after the worker went away
            await h.send(messages.WorkerStatus("c-thief", "colocated", 0, 0, 64, 64))  # heartbeat: no hello
            await asyncio.sleep(0.3)
            assert set(h.router.registry.workers) == {"c-good"}
            assert not h.router._tasks[0].done()  # the control loop is alive
            job = asyncio.create_task(collect(h.router, submit("r1")))
            assert await good.next_request() is not None
            assert await thief.next_request(timeout_s=0.3) is None
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
        finally:
            await h.close()

    run(scenario())
    err = capfd.readouterr().err
    assert err.count("router control socket: refused an unauthenticated message") >= 1
    assert "no deployment tag" in err
    assert "is not a ZeroMQ endpoint" in err


def test_control_loop_survives_a_failing_handler(model_dirs, capfd, monkeypatch):
    """Whatever a handler raises is logged and the loop goes on (it used to die unlogged)."""
    async def scenario():
        h = Harness(model_dirs["qwen3"])
        try:
            good = h.worker("c-good")
            calls = []
            real = h.router.registry.hello

            def flaky(msg, now):
                calls.append(msg.worker_id)
                if len(calls) == 1:
                    raise RuntimeError("registry bug")
                return real(msg, now)
            monkeypatch.setattr(h.router.registry, "hello", flaky)
            await h.send(dataclasses.replace(good.hello(), worker_id="c-first"))
            await h.send(good.hello())
            await h.router.wait_for_workers(0, 0, 1, timeout=5)
            assert "c-good" in h.router.registry.workers
        finally:
            await h.close()

    run(scenario())
    assert "router: control message dropped: RuntimeError: registry bug" in capfd.readouterr().err
