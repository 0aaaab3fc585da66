"""SamplingParams validation, the Sampler's filters, and sampling behaviour through the
offline LLM on the tiny qwen3 model: seeds, stop strings, ignore_eos and max_tokens."""
from __future__ import annotations

import json
import math
import re
import shutil
from collections import Counter

import pytest
import torch

from pdserve.common import LLM
from pdserve.common.engine.sampler import Sampler, _filter_top_k_top_p, greedy, make_generator
from pdserve.common.sampling_params import SamplingParams, SamplingParamsError

pytestmark = pytest.mark.usefixtures("torch_one_thread")


# ---- SamplingParams ----------------------------------------------------------------
BAD_PARAMS = [
    (dict(temperature=-0.5), ("temperature", "-0.5")),
    (dict(temperature=float("nan")), ("temperature", "nan")),
    (dict(top_p=0.0), ("top_p", "0.0")),
    (dict(top_p=1.5), ("top_p", "1.5")),
    (dict(top_p=-0.1), ("top_p", "-0.1")),
    (dict(max_tokens=0), ("max_tokens", "0")),
    (dict(max_tokens=-3), ("max_tokens", "-3")),
    (dict(top_k=-2), ("top_k", "-2")),
    (dict(stop=""), ("stop", "''")),
    (dict(stop=["ok", ""]), ("stop", "''")),
    (dict(stop=["ok", 3]), ("stop", "3")),
    (dict(seed=-2**63 - 1), ("seed", str(-2**63 - 1))),
    (dict(seed=2**63), ("seed", str(2**63))),
    (dict(min_p=-0.1), ("min_p", "-0.1")),
    (dict(min_p=1.5), ("min_p", "1.5")),
    (dict(min_p=float("nan")), ("min_p", "nan")),
    (dict(stop_token_ids=[-1]), ("stop_token_ids", "-1")),
    (dict(stop_token_ids=list(range(65))), ("stop_token_ids", "64")),
    (dict(min_tokens=-1), ("min_tokens", "-1")),
    (dict(min_tokens=17, max_tokens=16), ("min_tokens", "max_tokens=16", "17")),
    (dict(repetition_penalty=0.0), ("repetition_penalty", "0.0")),
    (dict(repetition_penalty=float("nan")), ("repetition_penalty", "nan")),
    (dict(repetition_penalty=101.0), ("repetition_penalty", "100")),
    (dict(presence_penalty=2.5), ("presence_penalty", "2.5")),
    (dict(presence_penalty=float("nan")), ("presence_penalty", "nan")),
    (dict(frequency_penalty=-2.01), ("frequency_penalty", "-2.01")),
    (dict(logit_bias={3: 101.0}), ("logit_bias", "101.0", "3")),
    (dict(logit_bias={3: float("nan")}), ("logit_bias", "nan")),
    (dict(logit_bias={-3: 1.0}), ("logit_bias", "-3")),
    (dict(logit_bias={"x": 1.0}), ("logit_bias", "'x'")),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), ("logit_bias", "1024")),
]


@pytest.mark.parametrize("kwargs, names", [
    pytest.param(kw, names, id=",".join(f"{k}={v!r}" for k, v in kw.items())) for kw, names in BAD_PARAMS])
def test_invalid_sampling_params_name_the_value(kwargs, names):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    for name in names:
        assert name in str(e.value)
    assert isinstance(e.value, ValueError)


def test_valid_sampling_params_are_kept():
    p = SamplingParams(temperature=0, top_p=1.0, top_k=1, max_tokens=1, stop="x", seed=0)
    assert p.greedy and p.stop == ["x"]
    assert not SamplingParams(temperature=1e-3, top_k=-1).greedy


# ---- Sampler -------------------------------------------------------------------------
def _logits(rows: int, vocab: int = 97, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits(16)
    out = Sampler(seed=1)(logits, [SamplingParams(temperature=0)] * 16, [None] * 16)
    assert out == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.05, 1.0, 50.0])
def test_top_k_1_is_argmax_at_any_temperature(temperature):
    logits = _logits(32, seed=3)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 32
    for seed in range(3):
        assert Sampler(seed=seed)(logits, params, [None] * 32) == logits.argmax(-1).tolist()


def test_mixed_batch_rows_keep_their_own_params():
    logits = _logits(4, seed=5)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=2.0, top_k=1),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    argmax = logits.argmax(-1).tolist()
    for seed in range(20):
        out = Sampler(seed=seed)(logits, params, [None] * 4)
        assert [out[0], out[1], out[3]] == [argmax[0], argmax[1], argmax[3]]


# known distribution over a permuted vocabulary (so the nucleus is not simply ids 0..k)
PROBS = [0.5, 0.3, 0.1, 0.04, 0.03, 0.02, 0.01]
PERM = [4, 0, 6, 2, 5, 1, 3]  # token id of the i-th most likely token


def _known_logits(rows: int) -> torch.Tensor:
    logits = torch.empty(len(PROBS))
    for p, tok in zip(PROBS, PERM):
        logits[tok] = math.log(p)
    return logits.repeat(rows, 1)


@pytest.mark.parametrize("top_p, top_k, nucleus", [
    (0.45, -1, 1), (0.75, -1, 2), (0.85, -1, 3), (0.95, -1, 5), (1.0, 3, 3), (0.85, 2, 2),
])
def test_filter_keeps_the_smallest_nucleus_and_renormalizes(top_p, top_k, nucleus):
    probs = torch.softmax(_known_logits(2), -1)
    out = _filter_top_k_top_p(probs, [top_k, -1], [top_p, 1.0])
    kept = PERM[:nucleus]
    mass = sum(PROBS[:nucleus])
    for i, tok in enumerate(PERM):
        want = PROBS[i] / mass if tok in kept else 0.0
        assert out[0, tok].item() == pytest.approx(want, abs=1e-6)
    # a row without filters in the same batch stays intact
    assert torch.allclose(out[1], probs[1], atol=1e-6)


@pytest.mark.parametrize("top_p, nucleus", [(0.75, 2), (0.85, 3)])
def test_top_p_draws_stay_in_the_nucleus(top_p, nucleus):
    n = 3000
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * n
    draws = Counter(Sampler(seed=0)(_known_logits(n), params, [None] * n))
    kept = PERM[:nucleus]
    assert set(draws) == set(kept), f"drew {sorted(draws)}, nucleus {sorted(kept)}"
    mass = sum(PROBS[:nucleus])
    for i, tok in enumerate(kept):
        assert abs(draws[tok] / n - PROBS[i] / mass) < 0.05


def test_temperature_sharpens_and_flattens():
    n = 2000
    logits = _known_logits(n)
    top = PERM[0]
    for temperature in (0.2, 5.0):
        draws = Counter(Sampler(seed=0)(logits, [SamplingParams(temperature=temperature)] * n, [None] * n))
        scaled = [p ** (1 / temperature) for p in PROBS]
        assert abs(draws[top] / n - scaled[0] / sum(scaled)) < 0.04, temperature
    assert len(draws) == len(PROBS)  # the hot one reaches every token


def test_seeded_generators_repeat_and_differ():
    logits = _logits(1, vocab=500)
    params = [SamplingParams(temperature=1.0, seed=11)]
    sampler = Sampler(seed=0)

    def draw(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [sampler(logits, params, [gen])[0] for _ in range(20)]

    assert draw(11) == draw(11)
    assert draw(11) != draw(12)


# ---- through the LLM -------------------------------------------------------------------
PROMPT = "The router sends each request to"


@pytest.fixture(scope="module")
def llm(model_dirs) -> LLM:
    return LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=128, max_model_len=256)


def _gen(llm: LLM, prompts, params) -> list[dict]:
    return llm.generate(prompts, params, use_tqdm=False)


def test_same_seed_same_output_different_seed_different_output(llm):
    p = SamplingParams(temperature=0.8, max_tokens=32, seed=1234, ignore_eos=True)
    a = _gen(llm, PROMPT, p)[0]["token_ids"]
    b = _gen(llm, PROMPT, p)[0]["token_ids"]
    c = _gen(llm, PROMPT, SamplingParams(temperature=0.8, max_tokens=32, seed=1235, ignore_eos=True))[0]["token_ids"]
    assert a == b
    assert a != c
    greedy = _gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]["token_ids"]
    assert a != greedy, "temperature 0.8 sampled exactly the greedy path"


def test_seeded_output_does_not_depend_on_the_batch(llm):
    p = SamplingParams(temperature=0.8, max_tokens=24, seed=99, ignore_eos=True)
    alone = _gen(llm, PROMPT, p)[0]["token_ids"]
    others = ["Hello, my name is", list(range(20, 60)), "A prefill worker computes"]
    params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.5, top_k=20, max_tokens=10, seed=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5)]
    outs = _gen(llm, [others[0], PROMPT, others[1], others[2]], [params[0], p, params[1], params[2]])
    assert outs[1]["token_ids"] == alone
    # and the same again after the engine-wide generator has moved on
    assert _gen(llm, [PROMPT, others[0]], [p, params[0]])[0]["token_ids"] == alone


def test_generator_state_hands_a_stream_to_another_engine(llm, model_dirs):
    """What a prefill worker does for its decode worker: after engine A drew the first
    token of a seeded request, engine B restores A's generator state and continues."""
    p = SamplingParams(temperature=1.0, max_tokens=20, seed=42, ignore_eos=True)
    whole = _gen(llm, PROMPT, p)[0]["token_ids"]
    a = llm.engine
    seq = a.add_request(PROMPT, p)
    while not seq.output_token_ids:
        a.step()
    state = a.runner.generator_state(seq.seq_id)
    assert len(state) > 0 and seq.output_token_ids == whole[:1]
    a.abort(seq)
    b = LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=128, max_model_len=256).engine
    handed = b.add_request(list(seq.token_ids), p)  # prompt + first token, as D holds it
    handed.num_prompt_tokens = seq.num_prompt_tokens  # the first token is an output
    b.runner.restore_generator(handed, state)
    while b.has_work():
        b.step()
    assert handed.output_token_ids == whole  # the first token, then B's 19 draws
    fresh = b.add_request(list(seq.token_ids), p)  # without the state: the seed restarts
    with pytest.raises(ValueError, match="sampler state of 3 bytes"):
        b.runner.restore_generator(fresh, b"\x01\x02\x03")
    b.abort(fresh)
    assert a.runner.generator_state(10**9) == b""  # no generator: nothing to hand over


def _ascii_word_run(text: str, start: int) -> tuple[int, str]:
    """The first run of >= 3 letters at or after `start`, and where it first occurs."""
    m = re.compile(r"[A-Za-z]{3,}").search(text, start)
    assert m, f"no word to stop on in {text!r}"
    stop = m.group(0)[:3]
    return text.find(stop), stop


def test_stop_string_cuts_the_text_right_before_it(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = _gen(llm, PROMPT, greedy)[0]
    text = full["text"]
    pos, stop = _ascii_word_run(text, len(text) // 3)
    assert pos > 0
    out = _gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[:pos]
    assert stop not in out["text"]
    n = len(out["token_ids"])
    assert n < len(full["token_ids"]) and out["token_ids"] == full["token_ids"][:n]
    assert stop in llm.tokenizer.decode(out["token_ids"]), "stopped before the stop string was generated"


def test_earliest_of_several_stop_strings_wins(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = _gen(llm, PROMPT, greedy)[0]["text"]
    early_pos, early = _ascii_word_run(text, 0)
    late_pos, late = _ascii_word_run(text, early_pos + 3)
    if late_pos < early_pos + 3:  # `late` also occurs earlier; it is then the earliest
        early_pos, early = late_pos, late
    out = _gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[late, early]))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[:min(early_pos, late_pos)]


def test_ignore_eos_and_max_tokens_give_exactly_max_tokens(llm, model_dirs, tmp_path):
    src = model_dirs["qwen3"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = _gen(llm, PROMPT, greedy)[0]["token_ids"]
    assert len(tokens) == 12
    # a copy of the model whose EOS is the 4th greedy token (first occurrence)
    eos = tokens[3]
    first = tokens.index(eos)
    shutil.copytree(src, tmp_path / "m")
    gen_cfg = tmp_path / "m" / "generation_config.json"
    gen_cfg.write_text(json.dumps({**json.loads(gen_cfg.read_text()), "eos_token_id": [eos]}))
    llm2 = LLM(tmp_path / "m", dtype="float32", num_kv_blocks=64, max_model_len=128)
    stopped = _gen(llm2, PROMPT, SamplingParams(temperature=0, max_tokens=12))[0]
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == tokens[:first + 1]
    kept = _gen(llm2, PROMPT, greedy)[0]
    assert kept["finish_reason"] == "length" and kept["token_ids"] == tokens
    for max_tokens in (1, 7, 40):
        outs = _gen(llm2, [PROMPT, list(range(30, 50))],
                    SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=5))
        assert [len(o["token_ids"]) for o in outs] == [max_tokens] * 2
        assert all(o["finish_reason"] == "length" for o in outs)


def test_max_model_len_ends_generation(llm):
    limit = llm.engine.config.scheduler.max_model_len
    out = _gen(llm, [list(range(10, 10 + limit - 3))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_greedy_is_torch_argmax_ties_nan_and_strided_rows_included():
    """numpy's argmax on CPU float32 picks what torch.argmax picks: the first of tied
    maxima, a NaN over any number, a row of -inf's first entry; rows taken with a step."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 49152), generator=g).float()  # many ties
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 100] = logits[3, 90] = 9.0
    for rows in (logits, logits[::2], logits.T.contiguous().T):
        assert greedy(rows) == rows.argmax(dim=-1).tolist()
    assert greedy(logits.double()) == logits.argmax(dim=-1).tolist()  # other dtypes: torch's own

