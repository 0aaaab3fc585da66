"""n > 1 on real worker processes, 1 prefill + 1 decode (shm) and colocated: the prompt is
prefilled once and its KV sent once; D forks the choices on landing. Seeded choices equal
the offline engine's on both deployments; every block is back after the request ends,
is aborted mid-stream, or has one choice stopped (the router's stop string)."""
from __future__ import annotations

import time

import pytest

from pdserve.common import LLM, SamplingParams
from pdserve.common.wire.messages import AbortRequest, ErrorReply, GenerateRequest, StepOutputs
from tests.support.disagg_driver import Deployment, engine_options, num_blocks, start_colocated, start_pair
from tests.support.helpers import mixed_prompts

OPTIONS = engine_options(num_kv_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def pair(model_dirs, tmp_path_factory):
    dep = start_pair(model_dirs["qwen3"], "shm", OPTIONS, workdir=tmp_path_factory.mktemp("n_pair"), together=True)
    yield dep
    dep.close()


@pytest.fixture(scope="module")
def colocated(model_dirs, tmp_path_factory):
    dep = start_colocated(model_dirs["qwen3"], OPTIONS, workdir=tmp_path_factory.mktemp("n_colocated"))
    yield dep
    dep.close()


@pytest.fixture(params=["pair", "colocated"])
def dep(request) -> Deployment:
    return request.getfixturevalue(request.param)


def choices(dep: Deployment, request_id: str, n: int, abort_after: int = 0, stop_choice: int = -1,
            timeout_s: float = 60.0) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Read request `request_id`'s entries until each of its n choices has its last one:
    (tokens per choice, finish reason per choice). `abort_after` > 0: abort the request
    once that many tokens came; `stop_choice` >= 0: stop that choice after its 2nd token."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    aborted = stopped = False
    while len(reasons) < n:
        assert time.monotonic() < deadline, f"choices {sorted(reasons)} of {n} finished\n{dep.logs()}"
        try:
            msg = dep.client.recv(timeout_ms=1000).msg
        except TimeoutError:
            continue
        assert not isinstance(msg, ErrorReply), f"{msg}\n{dep.logs()}"
        assert isinstance(msg, StepOutputs)
        for out in msg.outputs:
            assert out.request_id == request_id and out.index not in reasons
            tokens.setdefault(out.index, []).extend(out.token_ids)
            if out.finished:
                reasons[out.index] = out.finish_reason
        if abort_after and not aborted and sum(map(len, tokens.values())) >= abort_after:
            dep.send([AbortRequest(request_id)])  # type: ignore[list-item]
            aborted = True
        if stop_choice >= 0 and not stopped and len(tokens.get(stop_choice, ())) >= 2:
            dep.send([AbortRequest(request_id, stop_choice)])  # type: ignore[list-item]
            stopped = True
    return tokens, reasons


def submit(dep: Deployment, prompt: list[int], **sampling: object) -> str:
    req = dep.request(prompt, **sampling)
    dep.send([req])
    return req.request_id


def wait_baseline(dep: Deployment) -> None:
    """Every block of every worker free again (held ones are what a leak would leave)."""
    deadline = time.monotonic() + 10
    while True:
        statuses = [s for s in dep.statuses() if s is not None]
        if all(s.free_blocks == s.total_blocks and s.running == 0 for s in statuses):
            return
        assert time.monotonic() < deadline, f"blocks not back: {statuses}\n{dep.logs()}"
        time.sleep(0.1)


def test_seeded_choices_equal_the_offline_engine(dep, model_dirs, vocab_size):
    prompt = mixed_prompts(vocab_size, seed=3)[9]  # 65 tokens: a partial last block
    params = dict(n=4, temperature=1.0, seed=2024, max_tokens=10, ignore_eos=True)
    llm = LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=128, max_model_len=256)
    want = [o["token_ids"] for o in llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]["outputs"]]
    assert len({tuple(w) for w in want}) == 4, "the four choices differ"
    tokens, reasons = choices(dep, submit(dep, prompt, **params), 4)
    assert [tokens[i] for i in range(4)] == want
    assert set(reasons.values()) == {"length"}
    wait_baseline(dep)


def test_greedy_choices_equal_transformers(dep, model_dirs, hf_greedy, vocab_size):
    prompt = mixed_prompts(vocab_size, seed=4)[6]
    tokens, _ = choices(dep, submit(dep, prompt, n=3, max_tokens=8, ignore_eos=True), 3)
    assert [tokens[i] for i in range(3)] == [hf_greedy(model_dirs["qwen3"], prompt, 8)] * 3
    wait_baseline(dep)


def test_the_prompt_is_prefilled_and_sent_once(pair, vocab_size):
    prompt = mixed_prompts(vocab_size, seed=5)[10]  # 100 tokens, 7 blocks
    d0, p0 = pair.statuses()
    choices(pair, submit(pair, prompt, n=5, temperature=0.8, max_tokens=4), 5)
    d1, p1 = pair.statuses()
    assert p1.counters["prefills"] - p0.counters["prefills"] == 1
    assert p1.counters["blocks_sent"] - p0.counters["blocks_sent"] == num_blocks(prompt)
    assert d1.counters["blocks_received"] - d0.counters["blocks_received"] == num_blocks(prompt)
    assert d1.counters["finished"] - d0.counters["finished"] == 1
    wait_baseline(pair)


def test_abort_mid_stream_frees_every_choice(dep, vocab_size):
    prompt = mixed_prompts(vocab_size, seed=6)[8]
    rid = submit(dep, prompt, n=3, temperature=1.0, seed=1, max_tokens=200, ignore_eos=True)
    tokens, reasons = choices(dep, rid, 3, abort_after=6)
    assert set(reasons.values()) == {"abort"} and sum(map(len, tokens.values())) < 3 * 200
    wait_baseline(dep)


def test_one_choice_stopped_the_others_go_on(dep, vocab_size):
    prompt = mixed_prompts(vocab_size, seed=7)[5]
    tokens, reasons = choices(dep, submit(dep, prompt, n=3, temperature=1.0, seed=2, max_tokens=30,
                                          ignore_eos=True), 3, stop_choice=1)
    assert reasons == {0: "length", 1: "abort", 2: "length"}
    assert len(tokens[0]) == len(tokens[2]) == 30 and len(tokens[1]) < 30
    wait_baseline(dep)


def test_bad_n_is_refused_by_the_worker(pair):
    bad = GenerateRequest("bad-n", [5, 6, 7], SamplingParams.unchecked(n=0), prefill_addr=pair.prefill_addr)
    pair.send([bad])
    result = pair.collect(["bad-n"])
    assert "n must be in [1, 128]" in result.errors["bad-n"].message
