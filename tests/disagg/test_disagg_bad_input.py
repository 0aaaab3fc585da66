"""Bad input to a decode worker: each gets an ErrorReply that names the problem, the
worker keeps running, and a valid request sent alongside completes with the right
tokens."""
from __future__ import annotations

import time

import msgpack
import pytest

from pdserve.router.launch.local import free_port
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import PROTOCOL_VERSION, GenerateRequest, KVReady, StepOutputs, encode
from tests.support.disagg_driver import Deployment, engine_options, start_pair, start_single

MAX_MODEL_LEN = 128
MAX_NEW = 8
VALID_PROMPT = list(range(3, 40))


def _raw(type_: str, data: object, v: object = PROTOCOL_VERSION) -> list[bytes]:
    return [msgpack.packb({"v": v, "type": type_, "data": data})]


def _generate_data(**over: object) -> dict:
    data = {"request_id": "raw", "prompt_token_ids": [5, 6, 7], "sampling": {"temperature": 0.0}}
    data.update(over)
    return {k: v for k, v in data.items() if v is not None}


# Undecodable input: the worker cannot know the request id, so the reply carries none.
# name -> (multipart message, words the reply must contain)
MALFORMED = {
    "not_msgpack": ([b"\xc1\xc1 this is not msgpack"], ["msgpack"]),
    "not_a_map": ([msgpack.packb([1, 2, 3])], ["map"]),
    "unknown_type": (_raw("launch_missiles", {}), ["unknown message type", "launch_missiles"]),
    "wrong_version": (_raw("generate", _generate_data(), v=PROTOCOL_VERSION + 7), ["version"]),
    "wrong_field_type": (_raw("generate", _generate_data(prompt_token_ids="hello")), ["prompt_token_ids", "list"]),
    "wrong_token_type": (_raw("generate", _generate_data(prompt_token_ids=[5, "six"])), ["prompt_token_ids"]),
    "wrong_nested_type": (_raw("generate", _generate_data(sampling={"max_tokens": "many"})), ["sampling.max_tokens"]),
    "missing_field": (_raw("generate", _generate_data(request_id=None)), ["missing", "request_id"]),
    "unknown_field": (_raw("generate", _generate_data(priority=3)), ["unknown field", "priority"]),
    "message_for_other_role": ([encode(KVReady("x", 1, 1))], ["kv_ready"]),
}

# Well-formed requests the worker must refuse: name -> (prompt, sampling overrides, words)
REFUSED = {
    "prompt_too_long": (list(range(3, 3 + 2 * MAX_MODEL_LEN)), {}, ["max_model_len", str(MAX_MODEL_LEN)]),
    "prompt_at_limit": (list(range(3, 3 + MAX_MODEL_LEN)), {}, ["max_model_len"]),
    "max_tokens_zero": ([5, 6, 7], {"max_tokens": 0}, ["max_tokens"]),
    "empty_prompt": ([], {}, ["empty"]),
    "token_outside_vocab": ([5, 10**6], {}, ["vocabulary", str(10**6)]),
    "negative_temperature": ([5, 6], {"temperature": -1.0}, ["temperature"]),
}


@pytest.fixture(scope="module")
def pair(model_dirs, tmp_path_factory):
    dep = start_pair(model_dirs["qwen3"], "shm", engine_options(num_kv_blocks=64, max_model_len=MAX_MODEL_LEN),
                     workdir=tmp_path_factory.mktemp("bad-input"), together=True)
    yield dep
    dep.close()


def _check_valid(dep: Deployment, result, valid: GenerateRequest, model_dir: str, hf_greedy) -> None:
    assert valid.request_id not in result.errors, f"{result.errors[valid.request_id]}\n{dep.logs()}"
    assert result.tokens[valid.request_id] == hf_greedy(model_dir, VALID_PROMPT, MAX_NEW)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_message_gets_error_reply(case, pair, model_dirs, hf_greedy):
    frames, words = MALFORMED[case]
    valid = pair.request(VALID_PROMPT, MAX_NEW)
    pair.send([valid], raw=[frames])
    result = pair.collect([valid.request_id], num_anonymous=1)
    (err,) = result.anonymous_errors
    if case != "message_for_other_role":  # that one decodes fine; it is just not for D
        assert err.code == "malformed", err
    for word in words:
        assert word in err.message, f"{word!r} not in {err.message!r}"
    _check_valid(pair, result, valid, model_dirs["qwen3"], hf_greedy)


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_request_gets_error_reply(case, pair, model_dirs, hf_greedy):
    prompt, sampling, words = REFUSED[case]
    bad = pair.request(prompt, **{"max_tokens": MAX_NEW, **sampling})
    valid = pair.request(VALID_PROMPT, MAX_NEW)
    pair.send([bad, valid])
    result = pair.collect([bad.request_id, valid.request_id])
    assert bad.request_id in result.errors, f"bad request was served: {result.tokens.get(bad.request_id)}"
    err = result.errors[bad.request_id]
    for word in words:
        assert word in err.message, f"{word!r} not in {err.message!r}"
    _check_valid(pair, result, valid, model_dirs["qwen3"], hf_greedy)


def test_worker_healthy_after_bad_input(pair):
    d, p = pair.statuses()
    assert pair.decode.proc.poll() is None and pair.prefill.proc.poll() is None
    for s in (d, p):
        assert s.free_blocks == s.total_blocks, s
    assert d.counters["failed"] == 0  # refused requests never became requests


# ---- a bad prefill address -------------------------------------------------------------
# `prefill_addr` is client input. Each case gets its own pair: the failures they expose
# take the decode worker (or its link to its prefill worker) down with them.

PEER_TIMEOUT_S = 2.0  # short, so the unreachable-address cases are quick


def _fresh(model_dirs, tmp_path, backend: str) -> Deployment:
    return start_pair(model_dirs["qwen3"], backend, engine_options(num_kv_blocks=64, max_model_len=MAX_MODEL_LEN),
                      decode_options={"peer_timeout_s": PEER_TIMEOUT_S}, workdir=tmp_path)


@pytest.fixture
def fresh_shm_pair(model_dirs, tmp_path):
    dep = _fresh(model_dirs, tmp_path, "shm")
    yield dep
    dep.close(stop_timeout_s=3)


@pytest.fixture
def fresh_tcp_pair(model_dirs, tmp_path):
    dep = _fresh(model_dirs, tmp_path, "tcp")
    yield dep
    dep.close(stop_timeout_s=3)


@pytest.fixture
def lone_decode(model_dirs, tmp_path):
    """A decode worker with no prefill peer: it prefills requests with no prefill_addr."""
    dep = start_single(model_dirs["qwen3"], "decode", {**engine_options(num_kv_blocks=64, max_model_len=MAX_MODEL_LEN),
                                                       "kv_transfer": "shm"}, workdir=tmp_path)
    yield dep
    dep.close(stop_timeout_s=3)


def test_invalid_prefill_address_gets_error_reply(lone_decode, model_dirs, hf_greedy):
    """A string ZeroMQ cannot parse as an endpoint is refused like any other bad field."""
    dep = lone_decode
    bad = GenerateRequest("bad-addr", [5, 6, 7], SamplingParams(temperature=0.0), prefill_addr="not-an-endpoint")
    dep.send([bad])
    result = dep.collect([bad.request_id], timeout_s=8)
    assert "not-an-endpoint" in result.errors[bad.request_id].message
    valid = dep.request(VALID_PROMPT, MAX_NEW)
    dep.send([valid])
    _check_valid(dep, dep.collect([valid.request_id]), valid, model_dirs["qwen3"], hf_greedy)


def test_unreachable_prefill_address_fails_only_its_own_request(fresh_tcp_pair, model_dirs, hf_greedy):
    """Nobody answers at the address: that request fails, the healthy peer stays."""
    dep = fresh_tcp_pair
    nobody = f"tcp://127.0.0.1:{free_port()}"
    bad = GenerateRequest("nobody", [5, 6, 7], SamplingParams(temperature=0.0), prefill_addr=nobody)
    valid = dep.request(VALID_PROMPT, MAX_NEW)
    dep.send([bad, valid])  # the valid one arrives while D waits for the handshake
    result = dep.collect([bad.request_id, valid.request_id], timeout_s=30)
    assert nobody in result.errors[bad.request_id].message
    _check_valid(dep, result, valid, model_dirs["qwen3"], hf_greedy)
    assert "dropping prefill worker" not in dep.decode.log_tail()
    d = result.decode_status
    assert d.free_blocks == d.total_blocks, d


def test_unreachable_prefill_address_does_not_stall_running_requests(fresh_shm_pair):
    """Tokens of running requests keep streaming while D tries an unreachable address."""
    dep = fresh_shm_pair
    running = dep.request(VALID_PROMPT, 80, ignore_eos=True)
    dep.send([running])
    step = dep.client.recv(timeout_ms=30_000).msg
    assert isinstance(step, StepOutputs), step
    (first,) = step.outputs
    assert first.request_id == running.request_id and not first.finished, first
    nobody = f"tcp://127.0.0.1:{free_port()}"
    dep.send([GenerateRequest("nobody", [5, 6, 7], SamplingParams(temperature=0.0), prefill_addr=nobody)])
    arrivals, n_tokens = [time.monotonic()], len(first.token_ids)
    done = False
    while not done:
        msg = dep.client.recv(timeout_ms=30_000).msg
        for out in msg.outputs if isinstance(msg, StepOutputs) else []:
            if out.request_id == running.request_id:
                arrivals.append(time.monotonic())
                n_tokens += len(out.token_ids)
                done = out.finished
    assert n_tokens == 80
    worst_gap = max(b - a for a, b in zip(arrivals, arrivals[1:]))
    assert worst_gap < PEER_TIMEOUT_S / 2, (
        f"token stream stalled {worst_gap:.2f} s while D waited for an unreachable prefill worker")
