"""`pdserve scale` / `pdserve pools` (router/pools/client.py) against a router whose
sockets run CurveZMQ: with the secret it is answered; with another secret, or with Curve
off, it is refused at the handshake and says which."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.common.wire.auth import new_secret
from pdserve.router.core.config import RouterConfig
from pdserve.router.pools.control import ControlPlane
from pdserve.router.pools.client import ControlClient, ControlError
from pdserve.router.core.router import Router


def run_with_curve_router(model_dir: str, check) -> None:
    async def scenario():
        router = Router(RouterConfig(model_dir=model_dir, http_port=0, zmq_port=0, max_model_len=512), curve=True)
        router.start()
        plane = ControlPlane(router, None, "pdserve worker --role {role} --join tcp://R:1 --secret-file F M")
        plane.start()
        try:
            await asyncio.to_thread(check, router)
        finally:
            plane.close()
            await router.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_control_client_speaks_curve_to_a_curve_router(model_dirs):
    def check(router: Router) -> None:
        client = ControlClient(router.control_address, router.secret, timeout_s=5)  # auto: Curve first
        try:
            assert client.pools() == [] and client.curve
        finally:
            client.close()

    run_with_curve_router(model_dirs["qwen3"], check)


# a plain client usually hears "mechanism mismatch"; now and then libzmq drops it first with no detail
@pytest.mark.parametrize("case, why", [("other secret", "holds another deployment secret"),
                                       ("curve off", "--curve setting differs|no answer from the router")])
def test_a_control_client_the_router_cannot_trust_is_told_why(model_dirs, case, why):
    def check(router: Router) -> None:
        secret, curve = (new_secret(), None) if case == "other secret" else (router.secret, False)
        client = ControlClient(router.control_address, secret, timeout_s=5, curve=curve)
        try:
            with pytest.raises(ControlError, match=why):
                client.pools()
        finally:
            client.close()

    run_with_curve_router(model_dirs["qwen3"], check)
