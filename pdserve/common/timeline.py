"""The stamps of a request's timeline, in the order a disaggregated request passes them.
A timeline is a plain `dict[str, float]` of wall-clock seconds (`Clock.time()`, common/clock.py:
stamps from several processes on one host compare) so it travels on the wire as is; its
keys are only ever written through `mark`, with a `Stamp` and the caller's clock reading,
or through `count`, with a `Count`: the few numbers that are not times (speculative
decoding's draft and accepted tokens)."""
from __future__ import annotations

import enum


class Stamp(str, enum.Enum):
    ARRIVAL = "arrival"                  # router: request received
    ROUTED = "routed"                    # router: workers chosen
    ROUTE_DISAGG = "route_disagg"        # router: the prompt goes via the prefill worker (conditional mode)
    ROUTE_LOCAL = "route_local"          # router: the decode worker prefills it (conditional mode)
    DECODE_ARRIVAL = "decode_arrival"    # D (or colocated worker): request received
    DECODE_RESERVED = "decode_reserved"  # D: KV blocks reserved, prefill asked for
    PREFILL_QUEUED = "prefill_queued"    # P (or colocated): prompt queued
    PREFILL_START = "prefill_start"      # first prefill step began
    PREFILL_END = "prefill_end"          # prompt computed, first token sampled
    TRANSFER_START = "transfer_start"    # P: KV send begins
    TRANSFER_END = "transfer_end"        # P: KV send done (queued, for tcp/gloo)
    KV_READY = "kv_ready"                # D: KV landed in its blocks
    FIRST_TOKEN = "first_token"          # first token handed to the router
    FINISH = "finish"                    # last token handed to the router
    ROUTER_DONE = "router_done"          # router: final output relayed


class Count(str, enum.Enum):
    SPEC_DRAFT_TOKENS = "spec_draft_tokens"        # D (or colocated): draft tokens the request verified
    SPEC_ACCEPTED_TOKENS = "spec_accepted_tokens"  # D: of those, the accepted ones


Timeline = dict[str, float]


def mark(timeline: Timeline, stamp: Stamp, at: float, *, first: bool = False) -> None:
    """Set `stamp` to `at` (the caller's `clock.time()`); with `first`, keep an earlier value
    if there is one."""
    if first and stamp.value in timeline:
        return
    timeline[stamp.value] = at


def count(timeline: Timeline, what: Count, n: int) -> None:
    """Set the count `what` to `n` (a number of tokens, not a time)."""
    timeline[what.value] = float(n)
