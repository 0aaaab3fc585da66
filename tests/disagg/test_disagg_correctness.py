"""A real prefill/decode pair, for every architecture and every CPU transfer backend:
greedy output equals transformers' token for token, a second wave reuses D's prefix
cache (fewer blocks cross the wire), a request can share the prompt blocks of one still
decoding, and every block comes back once the work is done.

One pair per (arch, backend), shared by the tests of that combination."""
from __future__ import annotations

import random

import pytest

from pdserve.common.hashing import block_hashes, cacheable_prefix_hashes
from pdserve.common.wire.messages import StepOutputs
from tests.support.helpers import ARCHS
from tests.support.disagg_driver import BLOCK_SIZE, Deployment, RunResult, engine_options, num_blocks, start_pair
from tests.support.helpers import mixed_prompts

BACKENDS = ("shm", "gloo", "tcp")
MAX_NEW = 16
COMBOS = [(arch, backend) for arch in ARCHS for backend in BACKENDS]

# D holds 512 blocks, far more than both waves need, so nothing it cached is evicted and
# the prefix reuse of the second wave is exactly predictable. P's 64-token budget chunks
# long prompts and splits the budget between prompts, so KV is pushed block by block
# across several steps, at block boundaries and not.
OPTIONS = engine_options(num_kv_blocks=512, max_model_len=512)
PREFILL_OPTIONS = {"max_num_batched_tokens": 64}


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{a}-{b}" for a, b in COMBOS])
def pair(request, model_dirs, tmp_path_factory):
    arch, backend = request.param
    # shm and tcp: P first, then D on qwen3; together (D's start-up handshake waits for
    # P to come up) on the other archs, which also halves their start time. gloo: together.
    dep = start_pair(model_dirs[arch], backend, OPTIONS, prefill_options=PREFILL_OPTIONS,
                     workdir=tmp_path_factory.mktemp(f"{arch}-{backend}"), together=arch != "qwen3")
    yield dep
    dep.close()


@pytest.fixture(scope="module")
def first_wave(pair: Deployment, vocab_size) -> tuple[list[list[int]], RunResult]:
    """The mixed prompts, all in flight at once, on a fresh pair."""
    prompts = mixed_prompts(vocab_size, seed=7)
    return prompts, pair.run(prompts, MAX_NEW)


def _check_greedy(dep: Deployment, prompts: list[list[int]], result: RunResult, hf_greedy) -> None:
    assert not result.errors, f"requests failed: {result.errors}\n{dep.logs()}"
    for i, (prompt, got) in enumerate(zip(prompts, result.outputs())):
        want = hf_greedy(dep.model_dir, prompt, MAX_NEW)
        assert got == want, f"prompt {i} (len {len(prompt)}): ours {got} != hf {want}"


def test_greedy_matches_transformers(pair, first_wave, hf_greedy):
    prompts, result = first_wave
    _check_greedy(pair, prompts, result, hf_greedy)
    d = result.decode_status
    # every prompt block crossed over: nothing was cached on D before this wave
    assert d.counters["blocks_received"] == sum(num_blocks(p) for p in prompts)
    assert d.counters["blocks_reused"] == 0
    assert result.prefill_status.counters["prefills"] == len(prompts)
    assert d.counters["finished"] == len(prompts) and d.counters["failed"] == 0


def test_second_wave_reuses_decode_prefix_cache(pair, first_wave, vocab_size, hf_greedy):
    prompts1, result1 = first_wave
    before_d, before_p = pair.statuses()
    # D caches every full block whose KV it holds: each first-wave prompt plus the output
    # tokens it fed back (all but the last sampled one)
    cached = set()
    for p, out in zip(prompts1, result1.outputs()):
        cached.update(block_hashes(p + out[:-1], BLOCK_SIZE))
    rng = random.Random(3)
    prompts2 = [p + [rng.randrange(3, vocab_size) for _ in range(20)] for p in prompts1 if len(p) >= BLOCK_SIZE]
    # exact repeats: a prompt of whole blocks reuses all but its last block (its last
    # token is always computed), so P computes and D receives exactly one block
    prompts2 += [p for p in prompts1 if len(p) in (16, 64, 65)]
    expect_reused = []
    for q in prompts2:
        n = 0
        for h in cacheable_prefix_hashes(q, BLOCK_SIZE):
            if h not in cached:
                break
            n += 1
        expect_reused.append(n)
    assert sum(expect_reused) > 0  # the wave is built to share prefixes

    result2 = pair.run(prompts2, MAX_NEW)
    _check_greedy(pair, prompts2, result2, hf_greedy)
    after_d, after_p = result2.decode_status, result2.prefill_status
    received = after_d.counters["blocks_received"] - before_d.counters["blocks_received"]
    reused = after_d.counters["blocks_reused"] - before_d.counters["blocks_reused"]
    sent = after_p.counters["blocks_sent"] - before_p.counters["blocks_sent"]
    occupied = sum(num_blocks(q) for q in prompts2)
    assert reused == sum(expect_reused) > 0
    assert received == occupied - reused < occupied
    assert sent == received, "P pushed blocks that D already had (or fewer than it lacked)"
    for rid, q, n in zip(result2.request_ids, prompts2, expect_reused):
        assert result2.finals[rid].num_cached_tokens == n * BLOCK_SIZE, f"prompt of len {len(q)}"


def test_prefix_shared_with_a_running_request(pair, first_wave, vocab_size, hf_greedy):
    """B reuses the prompt blocks of A while A is still decoding (shared, in-use blocks)."""
    rng = random.Random(11)
    prompt_a = [rng.randrange(3, vocab_size) for _ in range(70)]
    prompt_b = prompt_a[:64] + [rng.randrange(3, vocab_size) for _ in range(9)]
    a = pair.request(prompt_a, 48)
    pair.send([a])
    step = pair.client.recv(timeout_ms=60_000).msg  # A's prompt KV is on D now
    assert isinstance(step, StepOutputs), step
    (first,) = step.outputs
    assert first.request_id == a.request_id and not first.finished, first
    b = pair.request(prompt_b, MAX_NEW)
    pair.send([b])
    result = pair.collect([a.request_id, b.request_id])
    assert not result.errors, f"{result.errors}\n{pair.logs()}"
    assert first.token_ids + result.tokens[a.request_id] == hf_greedy(pair.model_dir, prompt_a, 48)
    assert result.tokens[b.request_id] == hf_greedy(pair.model_dir, prompt_b, MAX_NEW)
    assert result.finals[b.request_id].num_cached_tokens == 64


SEEDED = [dict(temperature=1.0, seed=11), dict(temperature=0.8, top_p=0.9, seed=12),
          dict(temperature=1.3, top_k=20, seed=13)]


@pytest.fixture(scope="module")
def one_engine_seeded(model_dirs):
    """Seeded random outputs of one engine doing both phases (the offline LLM), per arch."""
    cache: dict[str, list[list[int]]] = {}

    def get(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
        if model_dir not in cache:
            from pdserve.common import LLM, SamplingParams
            llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=64, max_model_len=512, num_threads=1)
            params = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **kw) for kw in SEEDED]
            cache[model_dir] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        return cache[model_dir]
    return get


def test_seeded_sampling_continues_one_random_stream(pair, first_wave, vocab_size, one_engine_seeded):
    """P draws the first token and hands its generator state over: D's later draws are
    those one engine makes for the same seed (not a restart of the seed's stream)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (9, 40, 23)]
    requests = [pair.request(p, MAX_NEW, ignore_eos=True, **kw) for p, kw in zip(prompts, SEEDED)]
    pair.send(requests)
    result = pair.collect([r.request_id for r in requests])
    assert not result.errors, f"{result.errors}\n{pair.logs()}"
    got = result.outputs()
    assert got == one_engine_seeded(pair.model_dir, prompts)
    assert len({tuple(g) for g in got}) == 3 and all(len(set(g)) > 4 for g in got), "sampling looks greedy"


def test_free_blocks_return_to_total(pair, first_wave):
    """Runs last in the module: every block of every request above came back."""
    d, p = pair.statuses()
    for s in (d, p):
        assert (s.waiting, s.running) == (0, 0), s
        assert s.free_blocks == s.total_blocks == 512, s
