"""A client of the router's pool control API (router/pools/control.py), and the commands
built on it: `pdserve pools` lists the pools; `pdserve scale` grows, shrinks, drains and
changes roles, then (unless --no-wait) waits until the pools are as asked."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import zmq

from pdserve.common.config import ConfigError
from pdserve.common.wire.auth import AuthError, DeploymentKey, read_secret_file
from pdserve.common.wire.curve import is_loopback
from pdserve.common.wire.messages import (ChangeRole, ControlReply, DrainWorker, MessageError, PoolsRequest, PoolWorker,
                                  ScalePool)
from pdserve.common.wire.transport import Client, is_endpoint

REPLY_TIMEOUT_S = 10.0
POLL_S = 0.2


class ControlError(RuntimeError):
    """The router refused a request, or did not answer (wrong secret, wrong address)."""


class ControlClient:
    """Owns one authenticated DEALER connection to a router's control socket."""

    def __init__(self, address: str, secret: str, timeout_s: float = REPLY_TIMEOUT_S,
                 curve: bool | None = None) -> None:
        """`curve` None: CurveZMQ, and plain instead only where the router is on loopback and
        its handshake says it runs plain (`pdserve serve` on one host); never plain across hosts."""
        if not is_endpoint(address):
            raise ConfigError(f"--router must be the router's control address, tcp://HOST:PORT, got {address!r}")
        self.ctx = zmq.Context()
        self.address, self.secret = address, secret
        self.fallback = curve is None and is_loopback(address)
        self.client = self._connect(curve is not False)
        self.timeout_s = timeout_s

    def _connect(self, curve: bool) -> Client:
        self.curve = curve
        return Client(self.ctx, self.address, key=DeploymentKey(self.secret, curve), watch_handshakes=True)

    def call(self, msg: object) -> ControlReply:
        """Send one request and return the router's answer; ControlError if it refused or is silent."""
        self.client.send_or_drop(msg)  # never blocks: a failed handshake leaves no connection to queue on
        deadline = time.monotonic() + self.timeout_s
        curve_failed = ""
        while not self.client.sock.poll(50):
            why = self.client.handshakes.poll()
            if why is not None and self.fallback and self.curve:  # a plain router on loopback, or a wrong secret
                curve_failed = why
                self.client.close()
                self.client = self._connect(False)
                self.client.send_or_drop(msg)
            elif why is not None:  # plain failed too, as the router runs Curve: the Curve failure says why
                raise ControlError(f"cannot talk to the router at {self.address}: {curve_failed or why} "
                                   f"(--curve must be the router's, as `pdserve serve` prints it)")
            elif time.monotonic() > deadline:
                raise ControlError(f"no answer from the router at {self.address} within {self.timeout_s:.0f} s: "
                                   f"is it running there, and is this its deployment secret? (it answers only "
                                   f"requests signed with it)")
        try:
            reply = self.client.recv(0).msg
        except (AuthError, MessageError) as e:
            raise ControlError(f"bad answer from {self.client.address}: {e}") from None
        if not isinstance(reply, ControlReply):
            raise ControlError(f"unexpected answer from {self.client.address}: {type(reply).__name__}")
        if not reply.ok:
            raise ControlError(reply.message)
        return reply

    def pools(self) -> list[PoolWorker]:
        return self.call(PoolsRequest()).workers

    def scale(self, role: str, delta: int, engine: dict | None = None) -> ControlReply:
        return self.call(ScalePool(role, delta, dict(engine or {})))

    def drain(self, worker_id: str) -> ControlReply:
        return self.call(DrainWorker(worker_id))

    def change_role(self, worker_id: str, role: str, engine: dict | None = None) -> ControlReply:
        return self.call(ChangeRole(worker_id, role, dict(engine or {})))

    def wait(self, serving: dict[str, str], gone: set[str], timeout_s: float) -> list[PoolWorker]:
        """Poll until every worker in `serving` (id -> role) serves in that role and every
        id in `gone` has left; the pools then."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.pools()
            state = {w.worker_id: (w.state, w.role) for w in workers}
            failed = [w for w in workers if w.worker_id in serving and w.state == "exited"]
            if failed:
                raise ControlError(f"worker(s) {', '.join(w.worker_id for w in failed)} exited before serving "
                                   f"(exit code {failed[0].exit_code}); see the router's log")
            if all(state.get(w) == ("serving", role) for w, role in serving.items()) and \
                    all(state.get(w, ("exited",))[0] == "exited" for w in gone):
                return workers
            if time.monotonic() > deadline:
                raise ControlError(f"pools not as asked after {timeout_s:.0f} s: {_states(workers)}")
            time.sleep(POLL_S)

    def close(self) -> None:
        self.client.close()
        self.ctx.term()


def _states(workers: list[PoolWorker]) -> str:
    return ", ".join(f"{w.worker_id}={w.state}" for w in workers) or "no workers"


def format_pools(workers: list[PoolWorker]) -> str:
    rows = [("WORKER", "ROLE", "STATE", "INFLIGHT", "ROUTED", "STARTED BY", "ADDRESS")]
    for w in workers:
        state = w.state if w.exit_code is None else f"{w.state} ({w.exit_code})"
        rows.append((w.worker_id, w.role, state, str(w.inflight), str(w.routed),
                     "router" if w.managed else "joined", w.address or w.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip() for r in rows)


# ---- the commands ----------------------------------------------------------------------

def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, metavar="tcp://HOST:PORT",
                   help="the router's control address (what `pdserve serve` prints as 'Workers join')")
    p.add_argument("--secret-file", required=True, help="file (mode 0600) holding the deployment secret, hex")
    p.add_argument("--curve", default="auto", choices=("auto", "on", "off"),
                   help="CurveZMQ to the router, as the router has it (auto: on; plain only to a router on "
                        "loopback that runs plain)")
    p.add_argument("--json", action="store_true", help="print the pools as JSON")


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    p.add_argument("--prefill", type=_delta, default=0, metavar="+N|-N", help="grow or shrink the prefill pool")
    p.add_argument("--decode", type=_delta, default=0, metavar="+N|-N", help="grow or shrink the decode pool")
    p.add_argument("--colocated", type=_delta, default=0, metavar="+N|-N", help="grow or shrink the colocated pool")
    p.add_argument("--device", default="", help="where new workers run (default: where their role's workers run)")
    p.add_argument("--num-threads", type=int, default=0, help="CPU threads of each new worker (default: as its role's)")
    p.add_argument("--worker", action="append", default=[], metavar="ID", help="with --drain: the worker(s) to drain")
    p.add_argument("--drain", action="store_true", help="drain the --worker(s): they finish their requests and exit")
    p.add_argument("--role-of", action="append", default=[], metavar="ID=ROLE",
                   help="drain worker ID and start it again as ROLE (workers the router started only)")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the pools to be as asked")
    p.add_argument("--no-wait", action="store_true", help="return once the router has accepted the request")


def _delta(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected +N or -N, got {text!r}") from None


def _client(args: argparse.Namespace) -> ControlClient:
    try:
        curve = None if args.curve == "auto" else args.curve == "on"
        return ControlClient(args.router, read_secret_file(args.secret_file), curve=curve)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _print(workers: list[PoolWorker], as_json: bool) -> None:
    if as_json:
        import json
        from dataclasses import asdict
        print(json.dumps([asdict(w) for w in workers]))
    else:
        print(format_pools(workers))


def pools_main(args: argparse.Namespace) -> int:
    return _run(args, "pdserve pools", lambda client: client.pools())


def scale_main(args: argparse.Namespace) -> int:
    if args.worker and not args.drain:
        raise ConfigError("--worker names workers to drain: add --drain")
    if args.drain and not args.worker:
        raise ConfigError("--drain needs --worker ID")
    changes = [(r, getattr(args, r)) for r in ("prefill", "decode", "colocated") if getattr(args, r)]
    roles = [_role_of(text) for text in args.role_of]
    if not (changes or args.worker or roles):
        raise ConfigError("nothing to do: give --prefill/--decode/--colocated +N|-N, --worker ID --drain, "
                          "or --role-of ID=ROLE")

    def scale(client: ControlClient) -> list[PoolWorker]:
        serving: dict[str, str] = {}  # id -> the role it must serve in
        gone: set[str] = set()
        for role, delta in changes:
            reply = client.scale(role, delta, _engine(args))
            if delta > 0:
                serving.update(dict.fromkeys(reply.worker_ids, role))
            else:
                gone.update(reply.worker_ids)
            print(reply.message, file=sys.stderr)
        for wid in args.worker:
            gone.update(client.drain(wid).worker_ids)
        for wid, role in roles:
            print(client.change_role(wid, role, _engine(args)).message, file=sys.stderr)
            serving[wid] = role
        return client.pools() if args.no_wait else client.wait(serving, gone, args.wait)
    return _run(args, "pdserve scale", scale)


def _run(args: argparse.Namespace, prog: str, body: Callable[[ControlClient], list[PoolWorker]]) -> int:
    """Run `body(client)` and print the pools it returns; 1 with the reason when the router refused."""
    client = _client(args)
    try:
        _print(body(client), args.json)
    except ControlError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def _engine(args: argparse.Namespace) -> dict:
    """The engine options new workers get that differ from their role's."""
    return {k: v for k, v in (("device", args.device), ("num_threads", args.num_threads)) if v}


def _role_of(text: str) -> tuple[str, str]:
    wid, sep, role = text.partition("=")
    if not sep or not wid or not role:
        raise ConfigError(f"--role-of expects ID=ROLE, got {text!r}")
    return wid, role
