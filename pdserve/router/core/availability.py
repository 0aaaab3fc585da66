"""Which workers a request may be routed to, how a deployment serves when a pool is empty,
and how long a request waits when nothing can serve it: pure functions over plain data
(no sockets, no clocks). The router feeds them its registry (router/core/registry.py)
and acts on the answer (router/core/router.py); docs/reliability.md has the whole matrix.

A worker is *routable* when it is registered, alive, serving (not draining) and not
*suspected*: a worker whose last heartbeat is older than `suspect_after_s`, or whose
connection reported an error since it was last heard, gets no new request at once --
long before `stale_after_s` of silence declares it dead (its requests in flight are
re-routed only then, or when its process is seen to exit). A retry never goes to a
worker that already failed the request (`avoid`, by address: a worker restarted at a
new address is a new worker).

Plans, best first:
  prefill+decode  a routable prefill and decode worker: the prompt goes via P
  colocated       a routable colocated worker
  decode_local    decode workers but no prefill worker: the decode worker computes the
                  prompt itself (conditional disaggregation's local path). The deployment
                  is *degraded*: it serves, slower, and /health and /metrics say so
  none            nothing can serve: the request is held up to `worker_wait_s` for a
                  worker to register (or to be heard again), then refused (HTTP 503 +
                  Retry-After)
"""
from __future__ import annotations

from dataclasses import dataclass

PREFILL_DECODE, COLOCATED, DECODE_LOCAL, NONE = "prefill+decode", "colocated", "decode_local", "none"
OK, DEGRADED, UNAVAILABLE = "ok", "degraded", "unavailable"  # the deployment's serving state (/health)
ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class Liveness:
    """What routing may know of one registered worker's health."""

    worker_id: str
    address: str  # its process's address: a restarted worker has a new one
    role: str
    serving: bool  # alive and in the serving state (not draining, exiting or dead)
    silent_s: float  # since its last heartbeat (or hello), seconds
    connection_error: bool = False  # its connection reported an error since it was last heard


def suspected(w: Liveness, suspect_after_s: float) -> bool:
    """A worker that missed its heartbeats or whose connection failed: no new requests."""
    return w.connection_error or w.silent_s > suspect_after_s


def routable(workers: list[Liveness], suspect_after_s: float, avoid: frozenset[str] = frozenset()
             ) -> dict[str, list[str]]:
    """Role -> ids of the workers a request may go to now: serving, not suspected, and not
    one that already failed this request (`avoid`: addresses)."""
    out: dict[str, list[str]] = {r: [] for r in ROLES}
    for w in workers:
        if w.serving and not suspected(w, suspect_after_s) and w.address not in avoid and w.role in out:
            out[w.role].append(w.worker_id)
    return out


def plan(candidates: dict[str, list[str]]) -> str:
    """How a request is served with these routable workers (the module's list, best first)."""
    if candidates.get("prefill") and candidates.get("decode"):
        return PREFILL_DECODE
    if candidates.get("colocated"):
        return COLOCATED
    if candidates.get("decode"):
        return DECODE_LOCAL
    return NONE


def serving_state(how: str) -> str:
    """ok, degraded (prompts prefilled on decode workers for want of a prefill worker) or
    unavailable (nothing can serve: requests are held, then refused)."""
    return {PREFILL_DECODE: OK, COLOCATED: OK, DECODE_LOCAL: DEGRADED}.get(how, UNAVAILABLE)


def hold_left_s(since: float, now: float, wait_s: float) -> float:
    """How much longer a request that could not be routed since `since` may wait for a
    worker (seconds, >= 0; 0: refuse it now). Every hold of one request (the HTTP front
    end's before its 200, the router's own) counts from the same `since`, so they never
    add up past `wait_s`."""
    return max(0.0, since + wait_s - now)
