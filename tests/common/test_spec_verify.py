"""Speculative decoding keeps the target's distribution when it samples
(common/engine/spec/verify.py): the rejection sampler on fixed logits, each emitted token
against its row's distribution; and the whole engine, whose sampled tokens after the first
(the verified ones) follow the model's own conditional probabilities.

Each check is a chi-square goodness-of-fit test, failing when its p-value is below ALPHA:
a correct sampler fails one in 1 / ALPHA seeds (the seeds here are fixed, so the tests are
deterministic; a failure at another seed would be that rare)."""
from __future__ import annotations

import collections

import pytest
import torch

from pdserve.common import LLM, SamplingParams
from pdserve.common.engine.grammar import Grammars
from pdserve.common.engine.sampler import Sampler
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.spec.verify import verify
from tests.support.helpers import one_torch_thread

ALPHA = 1e-4
MIN_EXPECTED = 5.0  # cells expected to hold fewer are pooled into one


@pytest.fixture(autouse=True, scope="module")
def torch_one_thread_here():
    """Thousands of small tensor ops: a second intra-op thread on shared cores only waits."""
    with one_torch_thread():
        yield


def chi2_pvalue(observed: dict, expected_p: dict, n: int) -> float:
    """The p-value of `observed` counts (over n draws) against probabilities `expected_p`
    (cells absent from it have probability 0: a draw there fails at once)."""
    if set(observed) - set(expected_p):
        return 0.0
    cells, rest_o, rest_e = [], 0.0, 0.0
    for k, p in expected_p.items():
        if n * p >= MIN_EXPECTED:
            cells.append((observed.get(k, 0), n * p))
        else:
            rest_o, rest_e = rest_o + observed.get(k, 0), rest_e + n * p
    if rest_e > 0:
        cells.append((rest_o, rest_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    # the chi-square survival function: the regularized upper incomplete gamma Q(df / 2, stat / 2)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a row samples from without speculation: the sampler's own processing."""
    return Sampler.probs(logits[None], [params])[0]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t1", "top_k", "top_p"])
def test_rejection_sampler_keeps_each_rows_distribution(params):
    """Rows of fixed logits (row i: after the first i drafts), two drafts: the first of
    middling probability, the second likely; then the first emitted token follows row 0,
    the second, where the first draft was kept, row 1, and the third row 2."""
    vocab = 7
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5, 1.5, 0.0],
                           [0.0, 2.5, 0.3, 0.3, -0.5, 1.0, 0.1],
                           [1.2, 1.1, 1.0, 0.9, -2.0, 0.0, 0.4]])
    drafts = [5, 1]
    probs = [_distribution(row, params) for row in logits]
    sampler, grammars = Sampler(seed=0), Grammars("/unused", vocab)
    gen = torch.Generator().manual_seed(1234)
    n, per_call = 12000, 4000  # one verification step of `per_call` sequences at a time
    first, second, third = collections.Counter(), collections.Counter(), collections.Counter()
    for _ in range(n // per_call):
        seqs = [Sequence(i, [3, 4], params, spec_token_ids=list(drafts)) for i in range(per_call)]
        outs = verify(logits.repeat(per_call, 1), seqs, None, sampler, grammars, [gen] * per_call)
        for out in outs.values():
            tokens = [out.token, *(t for t, _ in out.more)]
            assert out.num_draft == 2 and tokens[:len(out.more)] == drafts[:len(out.more)]
            first[tokens[0]] += 1
            if tokens[0] == drafts[0]:
                second[tokens[1]] += 1
                if tokens[1] == drafts[1]:
                    third[tokens[2]] += 1
    for observed, p in ((first, probs[0]), (second, probs[1]), (third, probs[2])):
        total = sum(observed.values())
        assert total > 700, f"too few draws reach this row: {total}"
        expected = {t: float(p[t]) for t in range(vocab) if p[t] > 0}
        assert chi2_pvalue(observed, expected, total) > ALPHA, (observed, expected)


def test_greedy_rows_keep_drafts_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    params = SamplingParams(temperature=0)
    for drafts, want in (([1, 0], [1, 0, 2]), ([1, 2], [1, 0]), ([2, 0], [1])):
        seq = Sequence(0, [3], params, spec_token_ids=list(drafts))
        out = verify(logits, [seq], None, Sampler(), Grammars("/unused", 3), [None])[0]
        assert [out.token, *(t for t, _ in out.more)] == want


@pytest.fixture(scope="module")
def spec(model_dirs) -> LLM:
    cfg = {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 2,
           "adaptive": False}
    return LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=2048, max_model_len=256, max_num_seqs=128,
               speculative_config=cfg, enable_prefix_caching=False)


def test_sampled_output_follows_the_models_distribution(spec, model_dirs):
    """Temperature 1 over each position's top 3: the first token comes from the prompt's
    step, the next two from a verification of two greedy drafts (an int8 copy's). Their
    joint frequencies over many seeds match p(t1) p(t2 | t1) p(t3 | t1 t2), those
    conditionals computed by the same model without speculation."""
    plain = LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=256, max_model_len=256, enable_prefix_caching=False)
    prompt = [5, 17, 300, 42, 9, 1000, 77, 3, 512, 64, 8]
    top_k = 3

    def conditional(prefix: list[int]) -> dict[int, float]:
        lp = plain.generate(prefix, SamplingParams(temperature=0, max_tokens=1, logprobs=top_k), use_tqdm=False)[0]
        lps = lp["logprobs"][0]
        p = torch.softmax(torch.tensor(lps.top_logprobs), dim=0)  # temperature 1 over the top 3
        return dict(zip(lps.top_ids, p.tolist()))

    expected: dict[tuple[int, ...], float] = {}
    for t1, p1 in conditional(prompt).items():
        for t2, p2 in conditional(prompt + [t1]).items():
            for t3, p3 in conditional(prompt + [t1, t2]).items():
                expected[(t1, t2, t3)] = p1 * p2 * p3
    per_request, requests = 100, 24
    params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True, n=per_request, seed=1000 * i)
              for i in range(requests)]
    outs = spec.generate([prompt] * requests, params, use_tqdm=False)
    observed = collections.Counter(tuple(c["token_ids"]) for o in outs for c in o["outputs"])
    n = per_request * requests
    stats = spec.engine.speculator.stats
    assert stats.num_draft_tokens >= n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert chi2_pvalue(observed, expected, n) > ALPHA, sorted(observed.items())
