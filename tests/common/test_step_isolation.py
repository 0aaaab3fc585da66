"""A step that raises for one request fails that request alone: the engine finds the
culprit by re-running the batch in parts, releases it with an error, and every other
sequence of the batch finishes token for token as it would have without it."""
from __future__ import annotations

import pytest

from pdserve.common import LLM, SamplingParams
from pdserve.common.engine.engine import StepOutput

PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], [21, 22, 23, 24] * 5, [31, 32], [41, 42, 43, 44, 45, 46]]
POISON = 777  # a token id only the culprit's prompt holds


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=64, max_model_len=256)


def _poison_sampler(runner, monkeypatch, calls: list[int]) -> None:
    """Sampling raises whenever the culprit is among the sampled sequences, as a bad
    per-request input inside the sampler would."""
    real = runner.sample_logits  # every step's sampling, a decode step's fused logits too

    def sample(logits, seqs, top=None):
        calls.append(len(seqs))
        if any(POISON in s.token_ids for s in seqs):
            raise FloatingPointError("poisoned sequence")
        return real(logits, seqs, top)
    monkeypatch.setattr(runner, "sample_logits", sample)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_culprit_fails_alone_rest_token_exact(llm, monkeypatch, params):
    clean = llm.generate(PROMPTS, params, use_tqdm=False)
    calls: list[int] = []
    _poison_sampler(llm.engine.runner, monkeypatch, calls)
    culprit = [POISON, 5, 6, 7]
    out = llm.generate(PROMPTS[:2] + [culprit] + PROMPTS[2:], params, use_tqdm=False)
    assert out[2]["finish_reason"] == "error" and "poisoned sequence" in out[2]["error"]
    assert out[2]["token_ids"] == []
    rest = out[:2] + out[3:]
    assert [o["token_ids"] for o in rest] == [c["token_ids"] for c in clean]
    assert all("error" not in o for o in rest)
    assert max(calls) == len(PROMPTS) + 1  # it did run batched, and was split
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks  # nothing leaked
    # and the engine goes on serving
    monkeypatch.undo()
    assert llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]["token_ids"] == clean[0]["token_ids"]


@pytest.mark.timeout(120)  # the bug this guards against looped forever
def test_a_culprit_alone_in_its_step_fails_at_once(llm, monkeypatch):
    """A step of the culprit alone (it arrived on its own, as under a light load) is its
    failure: no re-run, the request ends with the error and the engine goes on."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    calls: list[int] = []
    _poison_sampler(llm.engine.runner, monkeypatch, calls)
    out = llm.generate([[POISON, 5, 6, 7]], params, use_tqdm=False)
    assert out[0]["finish_reason"] == "error" and "poisoned sequence" in out[0]["error"]
    assert calls == [1]  # the one step, not run again
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    monkeypatch.undo()
    assert len(llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]["token_ids"]) == 4


def test_culprit_mid_decode(llm, monkeypatch):
    """The culprit turns bad only after some decode steps (its 3rd output token): the
    others' decode batch goes on untouched, the culprit's tokens so far stand."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    clean = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    victim = seqs[1]
    real = engine.runner.sample_logits

    def sample(logits, batch_seqs, top=None):
        if victim in batch_seqs and victim.num_output_tokens >= 3:
            raise IndexError("bad row")
        return real(logits, batch_seqs, top)
    monkeypatch.setattr(engine.runner, "sample_logits", sample)
    failures: list[StepOutput] = []
    while engine.has_work():
        failures += [o for o in engine.step() if o.error]
    assert [f.seq for f in failures] == [victim] and "IndexError: bad row" in failures[0].error
    assert victim.output_token_ids == clean[1]["token_ids"][:3]
    for i, s in enumerate(seqs):
        if s is not victim:
            assert s.output_token_ids == clean[i]["token_ids"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
