"""common.wire.messages: every registered message survives encode/decode, and decoding
rejects whatever does not match the declared, versioned structure."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import msgpack
import pytest
import zmq

from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.wire import messages
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import (MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ErrorReply, GenerateRequest, KVReady, MessageError,
                                  RequestOutput, StatusRequest, StepOutputs, decode, encode)
from pdserve.common.wire.transport import Client, Server


def _sample(tp: Any, n: int) -> Any:
    """A non-default value of type `tp` (n varies the values)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return {"k": [n, "v", 1.5, None, True]}
    if origin in (Union, types.UnionType):
        return _sample(next(a for a in typing.get_args(tp) if a is not type(None)), n)
    if origin is list:
        (arg,) = typing.get_args(tp)
        return [_sample(arg, n), _sample(arg, n + 1)]
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return (_sample(args[0], n), _sample(args[0], n + 1))
        return tuple(_sample(a, n + i) for i, a in enumerate(args))
    if origin is dict:
        k, v = typing.get_args(tp)
        return {_sample(k, n): _sample(v, n), _sample(k, n + 1): _sample(v, n + 1)}
    if dataclasses.is_dataclass(tp):
        return _instance(tp, n)
    return {str: f"s{n}", int: 1000 + n, float: 0.25 + n, bool: n % 2 == 0, bytes: bytes([n % 256, 0, 255])}[tp]


def _instance(cls: type, n: int = 0) -> Any:
    hints = typing.get_type_hints(cls)
    make = getattr(cls, "unchecked", cls)  # SamplingParams: the values below need not be in range
    return make(**{f.name: _sample(hints[f.name], n + i) for i, f in enumerate(dataclasses.fields(cls))})


REGISTERED = sorted(messages._REGISTRY.items())


def test_registry_holds_the_protocol():
    want = {"generate", "abort", "token_output", "error", "status_request", "worker_status", "kv_handshake",
            "kv_handshake_reply", "prefill", "kv_ready", "prefill_failed", "sampling", "kv_layout",
            "step_outputs", "request_output"}
    assert want <= set(messages._REGISTRY)
    for tag, cls in REGISTERED:
        assert cls.TYPE == tag


@pytest.mark.parametrize("tag, cls", REGISTERED, ids=[t for t, _ in REGISTERED])
def test_round_trip_every_registered_type(tag, cls):
    for msg in (_instance(cls, 0), _instance(cls, 7)):
        raw = encode(msg)
        assert isinstance(raw, bytes)
        back = decode(raw)
        assert type(back) is cls and back == msg
        obj = msgpack.unpackb(raw)
        assert obj["v"] == PROTOCOL_VERSION and obj["type"] == tag


@pytest.mark.parametrize("tag, cls", REGISTERED, ids=[t for t, _ in REGISTERED])
def test_round_trip_with_defaults(tag, cls):
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    hints = typing.get_type_hints(cls)
    msg = cls(**{name: _sample(hints[name], 3) for name in required})
    assert decode(encode(msg)) == msg


def test_optional_fields_accept_null():
    msg = GenerateRequest("r", [1, 2], SamplingParams(stop=None, seed=None))
    assert decode(encode(msg)).sampling.stop is None


def test_binary_fields_take_only_binary():
    ok = decode(_raw("kv_ready", {"request_id": "r", "first_token": 1, "num_blocks": 2, "sampler_state": b"\x00\x01"}))
    assert ok.sampler_state == b"\x00\x01"
    with pytest.raises(MessageError, match="sampler_state: expected binary data, got str"):
        decode(_raw("kv_ready", {"request_id": "r", "first_token": 1, "num_blocks": 2, "sampler_state": "abc"}))


def test_int_is_accepted_for_float_and_becomes_float():
    raw = _raw("sampling", {"temperature": 1})
    s = decode(raw)
    assert s.temperature == 1.0 and isinstance(s.temperature, float)


def _raw(type_: Any, data: Any, v: Any = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"v": v, "type": type_, "data": data}, use_bin_type=True)


GOOD = {"request_id": "r", "prompt_token_ids": [1, 2, 3], "sampling": {"temperature": 0.0, "max_tokens": 4}}


def _gen(**over: Any) -> bytes:
    data = {**GOOD, **over}
    return _raw("generate", {k: v for k, v in data.items() if v is not ...})


def test_a_peer_of_an_older_version_is_understood_for_the_types_it_knows():
    """Types only gain fields with defaults across versions (any other change is a new
    type): a version-1 client's submit decodes as it did; types newer than the message's
    version are refused above."""
    from pdserve.common.wire.messages import OLDEST_VERSION, SubmitRequest
    raw = _raw("submit", {"request_id": "s", "sampling": {"max_tokens": 3}, "prompt": "hi"}, v=OLDEST_VERSION)
    assert decode(raw) == SubmitRequest("s", SamplingParams.unchecked(max_tokens=3), prompt="hi")


def test_the_good_generate_decodes():
    msg = decode(_gen())
    assert msg == GenerateRequest("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))


@pytest.mark.parametrize("raw, words", [
    (b"\xc1garbage", ["msgpack"]),
    (msgpack.packb([1, 2]), ["map"]),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "generate"}), ["map", "keys"]),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "generate", "data": GOOD, "extra": 1}), ["keys"]),
    (_raw("no_such_type", {}), ["unknown message type", "no_such_type"]),
    (_raw(5, {}), ["unknown message type"]),
    (_raw("generate", GOOD, v=PROTOCOL_VERSION + 1), ["version", str(PROTOCOL_VERSION + 1)]),
    (_raw("generate", GOOD, v="1"), ["version"]),
    (_raw("generate", GOOD, v=0), ["version", "0"]),
    (_raw("generate", GOOD, v=True), ["version"]),
    (_raw("step_outputs", {"outputs": []}, v=1), ["step_outputs", "new in protocol version 2"]),
    (_raw("generate", [1, 2]), ["generate", "map"]),
    (_gen(bogus=1), ["unknown field", "bogus"]),
    (_gen(request_id=...), ["missing field", "request_id"]),
    (_gen(sampling=...), ["missing field", "sampling"]),
    (_gen(request_id=5), ["generate.request_id", "str"]),
    (_gen(request_id=None), ["generate.request_id"]),
    (_gen(prompt_token_ids="abc"), ["generate.prompt_token_ids", "list"]),
    (_gen(prompt_token_ids=[1, 2.5]), ["generate.prompt_token_ids[1]", "integer"]),
    (_gen(prompt_token_ids=[1, True]), ["generate.prompt_token_ids[1]", "integer"]),
    (_gen(sampling="greedy"), ["generate.sampling", "map"]),
    (_gen(sampling={"temperature": "hot"}), ["generate.sampling.temperature", "number"]),
    (_gen(sampling={"max_tokens": True}), ["generate.sampling.max_tokens", "integer"]),
    (_gen(sampling={"nucleus": 0.9}), ["generate.sampling", "unknown field", "nucleus"]),
    (_gen(sampling={"stop": ["a", 3]}), ["generate.sampling.stop"]),
    (_gen(timeline={"t": "soon"}), ["generate.timeline"]),
    (_raw("kv_handshake", {"decode_id": "d", "decode_addr": "a", "backend": "shm",
                           "layout": {"dtype": "float32"}}), ["kv_handshake.layout", "missing field"]),
    # a worker's step message: every entry checked like a message of its own
    (_raw("step_outputs", {}), ["step_outputs", "missing field", "outputs"]),
    (_raw("step_outputs", {"outputs": {"request_id": "r"}}), ["step_outputs.outputs", "list"]),
    (_raw("step_outputs", {"outputs": [{"request_id": "r", "token_ids": [1]}, 7]}), ["step_outputs.outputs[1]", "map"]),
    (_raw("step_outputs", {"outputs": [{"request_id": "r"}]}), ["step_outputs.outputs[0]", "missing field", "token_ids"]),
    (_raw("step_outputs", {"outputs": [{"request_id": "r", "token_ids": [1, "2"]}]}),
     ["step_outputs.outputs[0].token_ids[1]", "integer"]),
    (_raw("step_outputs", {"outputs": [{"request_id": "r", "token_ids": [], "text": "hi"}]}),
     ["step_outputs.outputs[0]", "unknown field", "text"]),
    (_raw("step_outputs", {"outputs": [{"request_id": "r", "token_ids": [], "finished": 1}]}),
     ["step_outputs.outputs[0].finished", "bool"]),
])
def test_decode_rejects(raw, words):
    with pytest.raises(MessageError) as e:
        decode(raw)
    for word in words:
        assert word in str(e.value), f"{word!r} not in {str(e.value)!r}"


def test_step_outputs_round_trip_keeps_every_entry_in_order():
    msg = StepOutputs([RequestOutput("a", [5]), RequestOutput("b", [], finished=True, finish_reason="abort"),
                       RequestOutput("c", [7, 8], True, "length", 12, 4, {"arrival": 1.5})])
    back = decode(encode(msg))
    assert back == msg and all(type(e) is RequestOutput for e in back.outputs)
    assert msgpack.unpackb(encode(msg))["data"]["outputs"][2]["timeline"] == {"arrival": 1.5}


def test_decode_rejects_oversized_message():
    big = encode(GenerateRequest("x" * MAX_MESSAGE_BYTES, [1], SamplingParams()))
    assert len(big) > MAX_MESSAGE_BYTES
    with pytest.raises(MessageError, match="exceeds the limit"):
        decode(big)
    with pytest.raises(MessageError, match="exceeds the limit"):
        decode(b"\0" * (MAX_MESSAGE_BYTES + 1))


def test_server_answers_malformed_input_and_keeps_going():
    ctx = zmq.Context()
    server = Server(ctx, "inproc://messages-test")
    client = Client(ctx, server.address)
    try:
        client.sock.send_multipart([b"\xc1 not msgpack"])
        client.send(StatusRequest())
        assert server.sock.poll(5000)
        assert server.recv() is None  # answered, not handed to the caller
        reply = client.recv(timeout_ms=5000).msg
        assert isinstance(reply, ErrorReply) and reply.code == "malformed" and "msgpack" in reply.message
        assert server.sock.poll(5000)
        assert isinstance(server.recv().msg, StatusRequest)
    finally:
        client.close()
        server.close()
        ctx.term()


def test_logprobs_travel_with_their_tokens_and_are_type_checked():
    lp = TokenLogprobs(-0.5, [3, 9], [-0.5, -1.25])
    msg = StepOutputs([RequestOutput("a", [3], logprobs=[lp]), RequestOutput("b", [4])])
    back = decode(encode(msg))
    assert back == msg and type(back.outputs[0].logprobs[0]) is TokenLogprobs and back.outputs[1].logprobs is None
    ready = decode(encode(KVReady("r", 3, 1, first_logprobs=lp)))
    assert ready.first_logprobs == lp
    raw = msgpack.unpackb(encode(msg))
    raw["data"]["outputs"][0]["logprobs"][0]["top_ids"] = ["x"]
    with pytest.raises(MessageError, match="top_ids"):
        decode(msgpack.packb(raw))
