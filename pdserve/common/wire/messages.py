"""Every message that crosses a socket: typed, versioned dataclasses and one msgpack codec.

Wire form: msgpack map {"v": PROTOCOL_VERSION, "type": <tag>, "data": {field: value}}.
Raw tensor bytes (tcp KV transfer) travel as extra ZeroMQ frames after the message.
Decoding rejects unknown versions, unknown types, unknown or missing fields and wrong
field types (checked by common/schema.py, the checker config files use too) with
MessageError; a process answers that with an ErrorReply and goes on.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from pdserve.common import schema
from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams, StructuredOutput

PROTOCOL_VERSION = 4  # 2: workers send one `step_outputs` per step instead of a `token_output` per token;
# 3: `submit` carries `tools` and chat messages their tool calls and replies; the pool control API
# (`pools_request` ... `worker_drain`); n > 1 (sampling `n`; `index` on outputs and abort; kv_ready's
# fork_* fields); prompt logprobs; `structured`'s reasoning_end; 4: speculative decoding's counts on
# `request_output` (num_draft_tokens, num_accepted_tokens)
OLDEST_VERSION = 1  # received messages may carry any version from here on, if their type existed then
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # a control message; KV data frames are not limited by this


class MessageError(ValueError):
    """A received message is malformed; the text says what is wrong."""


_REGISTRY: dict[str, type] = {}


def message(tag: str, since: int = OLDEST_VERSION):
    """Register a dataclass as a wire message under `tag`, new in protocol version
    `since`. Across versions a type only gains fields with defaults (any other change is a
    new type), so a peer that speaks an older version, whose messages lack those fields,
    is understood for every type it knows."""
    def wrap(cls):
        cls = dataclass(cls)
        cls.TYPE = tag
        cls.SINCE = since
        _REGISTRY[tag] = cls
        return cls
    return wrap


# ---- nested structures ------------------------------------------------------------

def register(tag: str, cls: type) -> type:
    """Register an existing dataclass (one that lives outside this module) as a wire structure."""
    cls.TYPE = tag  # type: ignore[attr-defined]
    cls.SINCE = OLDEST_VERSION  # type: ignore[attr-defined]
    _REGISTRY[tag] = cls
    return cls


# SamplingParams is the wire form itself: decoded `unchecked`, validated by whoever serves it.
register("sampling", SamplingParams)
register("structured_output", StructuredOutput)


@message("kv_layout")
class KVLayout:
    """What must agree between a prefill and a decode worker for KV to be portable."""
    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


# ---- client / router <-> workers ----------------------------------------------------

@message("generate")
class GenerateRequest:
    """Sent to a decode (or colocated) worker: serve this prompt. `prefill_addr` names
    the prefill worker that computes the prompt; empty means compute it locally."""
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prefill_addr: str = ""
    return_timeline: bool = False
    timeline: dict[str, float] = field(default_factory=dict)
    block_hashes: list[int] = field(default_factory=list)  # of the prompt's full blocks (common.hashing)


@message("submit")
class SubmitRequest:
    """Client -> router: exactly one of prompt (text), prompt_token_ids or messages (chat,
    rendered with the model's chat template). `add_special_tokens` None means the form's
    default, as vLLM: true for a text prompt (the tokenizer's BOS / post-processor),
    false for messages (the template carries them). The last four fields apply to
    messages only: `continue_final_message` leaves the last message open instead of
    adding a generation prompt; `chat_template_kwargs` are extra template variables;
    `tools` (version 3) are the OpenAI tool definitions the template renders. A message
    (version 3) may carry `tool_calls`, `tool_call_id` and `reasoning_content` beside
    `role`, `content` and `name`."""
    request_id: str
    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool = True
    return_timeline: bool = False
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


@message("worker_hello")
class WorkerHello:
    """Worker -> router on start: who it is and what it holds."""
    worker_id: str
    role: str
    address: str
    device: str
    total_blocks: int
    block_size: int
    model_fingerprint: str


@message("abort")
class AbortRequest:
    """Stop a request; router -> decode worker, `index` >= 0 stops that choice alone (n > 1:
    a stop string ended it), -1 every choice."""
    request_id: str
    index: int = -1


@message("token_output")
class TokenOutput:
    """New tokens of one request; the last one has finished=True. `text` is the text
    delta (filled by the router for clients; workers leave it empty)."""
    request_id: str
    token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    timeline: dict[str, float] | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asks
    index: int = 0  # the choice these tokens belong to (n > 1); each choice has its own last message
    # since 3: one per prompt token (the first None), on the request's first entry, when it asks
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@message("request_output", since=2)
class RequestOutput:
    """One request's share of a worker step: its new tokens (usually one; none on an
    abort), and on the last entry finished=True with the counts and timeline. Text is
    made once, by the router (common/text/detokenizer.py), never by the worker."""
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    timeline: dict[str, float] | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asks
    index: int = 0  # the choice (n > 1); each choice ends with its own finished entry
    # since 3: one per prompt token (the first None), on the request's first entry, when it asks
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # since 4, speculative decoding: one per verification the entry covers, its draft tokens and how
    # many of them were accepted (what the router's vllm:spec_decode_* metrics count)
    num_draft_tokens: list[int] = field(default_factory=list)
    num_accepted_tokens: list[int] = field(default_factory=list)


@message("step_outputs", since=2)
class StepOutputs:
    """Worker -> router, once per loop turn per router connection: every request's
    entry of that turn (the step's tokens and the first tokens of prompts whose KV
    landed), in the order they were produced. Errors travel apart, as `ErrorReply`."""
    outputs: list[RequestOutput]


@message("error")
class ErrorReply:
    request_id: str
    message: str
    code: str = "bad_request"


@message("status_request")
class StatusRequest:
    pass


@message("worker_status")
class WorkerStatus:
    """Load and counters of one worker; also its heartbeat."""
    worker_id: str
    role: str  # prefill | decode | colocated
    waiting: int
    running: int
    free_blocks: int
    total_blocks: int
    counters: dict[str, int] = field(default_factory=dict)
    kv_stored: list[int] = field(default_factory=list)  # block hashes newly cached
    kv_evicted: list[int] = field(default_factory=list)  # block hashes evicted


# ---- prefill <-> decode handoff ----------------------------------------------------

@message("kv_handshake")
class KVHandshake:
    """D -> P when they connect: D's KV layout and where/how P writes into D's cache."""
    decode_id: str
    decode_addr: str
    layout: KVLayout
    backend: str
    backend_info: dict[str, Any] = field(default_factory=dict)


@message("kv_handshake_reply")
class KVHandshakeReply:
    prefill_id: str
    ok: bool
    error: str = ""
    layout: KVLayout | None = None
    backend_info: dict[str, Any] = field(default_factory=dict)


@message("prefill")
class PrefillRequest:
    """D -> P: prefill this prompt and write the KV of blocks [skip_blocks, ...) into
    `dst_block_ids` (one per block from skip_blocks to the prompt's last block)."""
    request_id: str
    decode_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    skip_blocks: int
    dst_block_ids: list[int]
    timeline: dict[str, float] = field(default_factory=dict)
    block_hashes: list[int] = field(default_factory=list)  # of the prompt's full blocks (common.hashing)


@message("kv_ready")
class KVReady:
    """P -> D: the KV is in D's blocks (or follows: `num_frames` raw frames for tcp, or
    a gloo/nccl send of `payload_shape`); the prompt's first sampled token. A seeded
    random request also carries its generator's state after that draw (`sampler_state`,
    torch's bytes), so D goes on with the same random stream as one engine would."""
    request_id: str
    first_token: int
    num_blocks: int
    payload_shape: list[int] = field(default_factory=list)
    payload_dtype: str = ""
    num_frames: int = 0
    timeline: dict[str, float] = field(default_factory=dict)
    sampler_state: bytes = b""
    checksum: int = -1  # kv_transfer.integrity.kv_checksum of the sent blocks; -1: not computed
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asks
    # n > 1: choices 1..n-1, sampled from the same logits as `first_token`; the KV is sent once
    fork_tokens: list[int] = field(default_factory=list)
    fork_sampler_states: list[bytes] = field(default_factory=list)  # one per fork of a seeded request, else none
    fork_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per fork when the request asks, else none
    # since 3: one per prompt token (the first None), when the request asks; first_token is -1
    # when it samples none (max_tokens 0): D then ends it ("length") without decoding
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@message("prefill_failed")
class PrefillFailed:
    """P -> D: the prefill could not be done; D releases the reservation and reports."""
    request_id: str
    message: str


# ---- liveness (docs/reliability.md) --------------------------------------------------

@message("client_heartbeat")
class ClientHeartbeat:
    """Client -> router, every few seconds while it has requests in flight: a ZeroMQ
    ROUTER socket does not report a client that went away, so a client that heartbeats and
    then falls silent past the router's limit is gone and its requests are aborted."""
    interval_s: float = 2.0


# ---- pool control (router/pools/control.py, docs/deploy.md) -------------------------------------
# An operator (`pdserve scale`, an SLO planner) -> the router's control socket, signed with
# the deployment secret; every request gets one `control_reply`.

@message("pool_worker", since=3)
class PoolWorker:
    """One worker as the router sees it. state: starting (spawned, not registered yet),
    serving, draining (no new requests; its own finish), exiting (told to exit), exited
    (with `exit_code` where its launcher saw it), dead (silent or exited unasked) or failed
    (its launcher gave up starting it: `reason` says why)."""
    worker_id: str
    role: str
    state: str
    address: str = ""
    inflight: int = 0
    routed: int = 0  # requests routed to it since it registered
    managed: bool = False  # started by the router's launcher (it can stop and restart it)
    exit_code: int | None = None
    reason: str = ""  # why it failed (state "failed")


@message("pools_request", since=3)
class PoolsRequest:
    """List the pools."""


@message("scale_pool", since=3)
class ScalePool:
    """Grow (`delta` > 0: start that many workers of `role`) or shrink (`delta` < 0:
    drain that many of its serving workers, least loaded first) one pool. `engine`:
    engine options of the new workers that differ from the deployment's (e.g. "device",
    "num_threads"); checked as the engine flags are."""
    role: str
    delta: int
    engine: dict[str, Any] = field(default_factory=dict)


@message("drain_worker", since=3)
class DrainWorker:
    """Drain one worker: no new requests, its in-flight ones finish, then it exits."""
    worker_id: str


@message("change_role", since=3)
class ChangeRole:
    """Drain one worker, then start it again (same id, same device) in `role`, with
    `engine` options changed as in `scale_pool`."""
    worker_id: str
    role: str
    engine: dict[str, Any] = field(default_factory=dict)


@message("control_reply", since=3)
class ControlReply:
    """The router's answer to a control request: ok, what it did or why not, the workers
    it acted on, and the pools as they are after it."""
    ok: bool
    message: str
    worker_ids: list[str] = field(default_factory=list)
    workers: list[PoolWorker] = field(default_factory=list)
    can_spawn: bool = False  # whether this router starts workers itself (else: they join it)


@message("worker_drain", since=3)
class WorkerDrain:
    """Router -> worker, once nothing routed to it is left: finish what it holds and exit (code 0)."""


# ---- codec ---------------------------------------------------------------------------

def encode(msg: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": msg.TYPE, "data": _to_wire(msg)},
                         use_bin_type=True)


def decode(raw: bytes) -> Any:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(raw)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise MessageError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict) or set(obj) != {"v", "type", "data"}:
        raise MessageError("a message must be a map with exactly the keys v, type, data")
    v = obj["v"]
    if type(v) is not int or not OLDEST_VERSION <= v <= PROTOCOL_VERSION:
        raise MessageError(f"protocol version {v!r} is not supported (this side speaks "
                           f"{OLDEST_VERSION}..{PROTOCOL_VERSION})")
    cls = _REGISTRY.get(obj["type"]) if isinstance(obj["type"], str) else None
    if cls is None:
        raise MessageError(f"unknown message type {obj['type']!r}")
    if v < cls.SINCE:
        raise MessageError(f"message type {obj['type']!r} is new in protocol version {cls.SINCE}, "
                           f"this one says version {v}")
    return schema.build(cls, obj["data"], obj["type"], MessageError)


def _to_wire(msg: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        if dataclasses.is_dataclass(v):
            v = _to_wire(v)
        elif type(v) is list and v and (dataclasses.is_dataclass(v[-1]) or dataclasses.is_dataclass(v[0])):
            v = [None if x is None else _to_wire(x) for x in v]  # nested structures (prompt logprobs: first None)
        out[f.name] = v
    return out
