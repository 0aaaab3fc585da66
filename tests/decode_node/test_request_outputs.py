"""What a decode request streams: transformers' greedy tokens, computed locally or from a
prefill engine's first token and KV landed in the reserved blocks (at once or in
flight), and a seeded request going on whatever sampler state it is handed."""
from __future__ import annotations

import pytest

from pdserve.common.engine.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.decode_node.requests import State
from pdserve.common.wire.messages import StepOutputs
from tests.support.decode_harness import FakeTransfer, prompt


def test_local_greedy_matches_transformers(h, model_dirs, hf_greedy):
    p = prompt(45, 6)
    h.generate("a", p, max_tokens=10, local=True, ignore_eos=False)
    h.run_until_idle()
    assert h.tokens("a") == hf_greedy(model_dirs["qwen3"], p, 10)


@pytest.mark.parametrize("in_flight", [False, True])
def test_disaggregated_greedy_matches_transformers(h, decode_config, model_dirs, hf_greedy, in_flight):
    """P's side played by an offline prefill-only engine: its first token and its KV,
    copied into the blocks D reserved, make D stream exactly transformers' tokens."""
    p = prompt(50, 7)
    off = LLMEngine(decode_config, prefill_only=True)
    seq = off.new_sequence(p, SamplingParams(temperature=0.0, max_tokens=12))
    off.add(seq)
    (out,) = off.step()  # 50 tokens fit one step of the 64-token budget
    src = list(seq.block_table)
    cache = h.worker.engine.runner.kv_cache

    def fill(dst: list[int]) -> None:
        assert len(dst) == len(src)
        cache[:, :, dst] = off.runner.kv_cache[:, :, src]

    h.generate("a", p, max_tokens=12, ignore_eos=False)
    h.worker.try_reserve()
    h.receiver.fill["a"] = fill
    t = FakeTransfer()
    if in_flight:
        h.receiver.plan["a"] = t
    h.kv_ready("a", first_token=out.new_token)
    off.release(seq)
    if in_flight:
        h.turn()
        assert h.state("a") == State.RECEIVING
        t.finished = True
    h.run_until_idle()
    assert h.tokens("a") == hf_greedy(model_dirs["qwen3"], p, 12)


@pytest.mark.parametrize("state", [b"", b"not a generator state"])
def test_seeded_request_goes_on_whatever_the_sampler_state(h, state):
    """A sampler state that does not fit this engine is logged; the seed alone goes on."""
    h.generate("a", prompt(30, 26), max_tokens=5, temperature=1.0, seed=7)
    h.worker.try_reserve()
    h.kv_ready("a", first_token=4, sampler_state=state)
    assert h.state("a") == State.RUNNING
    h.run_until_idle()
    assert len(h.tokens("a")) == 5 and h.terminal("a").finish_reason == "length"


def test_one_message_per_step_holds_every_request(h):
    """Three requests on one router connection (one of them's KV lands during the loop
    turn) and one on another: the turn sends one StepOutputs per connection, one entry
    per request, the landed request's first token in the same message as the step's."""
    conns = {"a": b"router-0", "b": b"router-0", "d": b"router-0", "c": b"router-1"}
    for rid in "abc":
        h.generate(rid, prompt(20, ord(rid)), max_tokens=6, local=True)
    h.generate("d", prompt(20, 4), max_tokens=6)
    for rid, identity in conns.items():
        h.identities[rid] = h.req(rid).identity = identity
    h.worker.try_reserve()
    h.turn()  # the three local prompts' prefill: a first token each
    before = len(h.server.messages)
    h.kv_ready("d", first_token=9)  # lands mid-turn: queued for the turn's message, not sent
    assert len(h.server.messages) == before
    h.turn()
    turn = h.server.messages[before:]
    assert [(i, type(m)) for i, m in turn] == [(b"router-0", StepOutputs), (b"router-1", StepOutputs)]
    (_, zero), (_, one) = turn
    # d: its first token (landed) and the step's next one, in one entry
    assert [(e.request_id, len(e.token_ids)) for e in zero.outputs] == [("d", 2), ("a", 1), ("b", 1)]
    assert zero.outputs[0].token_ids[0] == 9
    assert [(e.request_id, len(e.token_ids)) for e in one.outputs] == [("c", 1)]
    h.run_until_idle()
    for rid in "abcd":
        assert len(h.tokens(rid)) == 6 and h.terminal(rid).finish_reason == "length"
