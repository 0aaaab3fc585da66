"""`n` > 1 through `pdserve serve` (1 prefill + 1 decode, and colocated), with the openai
client and the ZeroMQ client: n choices indexed 0..n-1 (a completion with several prompts:
prompt i's choice j is choice i * n + j, vLLM's order), each equal to the offline engine's
choice, streamed and not; stop strings end choices one by one; bad n is a 400 naming it;
every KV block is free again after a request, a stopped choice, or a client that left."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from pdserve.common import LLM, SamplingParams
from tests.support.serving import CHAT, MAX_MODEL_LEN, PROMPTS, chat_ids, openai_client

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")
MAX_NEW = 8


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(params=["pd", "colocated"])
def served(request):
    return request.getfixturevalue(request.param)


def offline(llm: LLM, prompt: str | list[int], **params: object) -> list[dict]:
    """The offline engine's choices of one request."""
    res = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    return res.get("outputs", [res])


def blocks(served) -> tuple[dict[str, str], dict[str, str]]:
    """(free, total) KV blocks per worker, as its last heartbeat (every 0.5 s) told /metrics."""
    text = httpx.get(f"{served.base}/metrics", timeout=10).text
    return tuple(dict(re.findall(r'^%s\{([^}]*)\} (\S+)$' % name, text, re.M))  # type: ignore[return-value]
                 for name in ("pdserve_worker_free_blocks", "pdserve_worker_total_blocks"))


def held(served) -> bool:
    free, total = blocks(served)
    return free != total


def wait_blocks_free(served, timeout_s: float = 15.0) -> None:
    """Every worker reports every KV block free: nothing a request held is left."""
    time.sleep(0.6)  # a heartbeat from after the request
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = blocks(served)
        if free and free == total:
            return
        assert time.monotonic() < deadline, f"KV blocks still held: {free} of {total}"
        time.sleep(0.2)


SEEDED = dict(temperature=1.0, seed=77, max_tokens=MAX_NEW, ignore_eos=True)
BODY = dict(temperature=1.0, seed=77, max_tokens=MAX_NEW, extra_body={"ignore_eos": True})  # SEEDED for openai


def test_chat_choices_streamed_and_not_equal_the_offline_engine(served, llm, tok):
    want = offline(llm, chat_ids(tok, CHAT), n=3, **SEEDED)
    assert len({tuple(w["token_ids"]) for w in want}) == 3
    oai = openai_client(served)
    res = oai.chat.completions.create(model="qwen3", messages=CHAT, n=3, **BODY)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert [c.token_ids for c in res.choices] == [w["token_ids"] for w in want]
    assert [c.message.content for c in res.choices] == [w["text"] for w in want]
    assert res.usage.prompt_tokens == len(chat_ids(tok, CHAT))  # once, not n times
    assert res.usage.completion_tokens == 3 * MAX_NEW
    ids: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in oai.chat.completions.create(model="qwen3", messages=CHAT, n=3, stream=True,
                                             stream_options={"include_usage": True}, **BODY):
        usage = chunk.usage or usage
        for c in chunk.choices:
            ids.setdefault(c.index, []).extend(c.token_ids)
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [ids[i] for i in range(3)] == [w["token_ids"] for w in want]
    assert [text[i] for i in range(3)] == [w["text"] for w in want]
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 3 * MAX_NEW
    wait_blocks_free(served)


def test_greedy_choices_are_identical(served, llm, tok):
    want = offline(llm, PROMPTS[0], temperature=0, max_tokens=MAX_NEW)[0]["token_ids"]
    res = openai_client(served).completions.create(model="qwen3", prompt=PROMPTS[0], n=3, temperature=0,
                                                   max_tokens=MAX_NEW)
    assert [c.token_ids for c in res.choices] == [want] * 3


@pytest.mark.parametrize("stream", [False, True])
def test_completions_several_prompts_times_n_in_vllm_order(served, llm, stream):
    prompts = [PROMPTS[0], PROMPTS[2]]
    want = [w for p in prompts for w in offline(llm, p, n=2, **SEEDED)]
    res = openai_client(served).completions.create(model="qwen3", prompt=prompts, n=2, stream=stream, **BODY)
    got: dict[int, list[int]] = {}
    if stream:
        for chunk in res:
            for c in chunk.choices:
                got.setdefault(c.index, []).extend(c.token_ids)
    else:
        assert [c.index for c in res.choices] == [0, 1, 2, 3]
        got = {c.index: c.token_ids for c in res.choices}
    assert [got[i] for i in range(4)] == [w["token_ids"] for w in want]


def test_stop_strings_end_choices_one_by_one(served, llm):
    base = offline(llm, PROMPTS[1], n=3, **SEEDED)
    stop = llm.tokenizer.decode(base[1]["token_ids"][2:4])  # in choice 1's text, maybe in others'
    want = offline(llm, PROMPTS[1], n=3, stop=[stop], **SEEDED)
    assert want[1]["finish_reason"] == "stop"
    res = openai_client(served).completions.create(model="qwen3", prompt=PROMPTS[1], n=3, stop=[stop], **BODY)
    assert [(c.text, c.finish_reason) for c in res.choices] == [(w["text"], w["finish_reason"]) for w in want]
    wait_blocks_free(served)


def test_client_leaving_mid_stream_frees_every_choice(served):
    with httpx.Client(timeout=60) as client:
        body = {"model": "qwen3", "prompt": PROMPTS[2], "n": 8, "max_tokens": 450, "ignore_eos": True,
                "temperature": 1.0, "stream": True}
        with client.stream("POST", f"{served.http}/completions", json=body) as r:
            assert r.status_code == 200
            for i, line in enumerate(r.iter_lines()):  # until a heartbeat shows the choices' blocks held
                assert line != "data: [DONE]", "the request ended before a heartbeat showed its blocks"
                if i % 20 == 0 and held(served):
                    break  # then the client goes away
    wait_blocks_free(served)


@pytest.mark.parametrize("n", [0, -1, 129])
def test_bad_n_is_a_400_naming_it(pd, n):
    for path, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": CHAT})):
        r = httpx.post(f"{pd.http}/{path}", json={"model": "qwen3", "max_tokens": 2, "n": n, **body}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "n" and "n must be in [1, 128]" in err["message"]


def test_zmq_client_choices(pd, llm):
    from pdserve.router.client import Client
    want = offline(llm, PROMPTS[0], n=3, **SEEDED)
    with Client(pd.zmq, timeout_s=60) as client:
        done = client.choices(PROMPTS[0], n=3, **SEEDED)
        streamed = list(client.stream(PROMPTS[0], n=3, **SEEDED))
        with pytest.raises(ValueError, match="choices"):
            client.generate(PROMPTS[0], n=3)
    assert [c.index for c in done] == [0, 1, 2]
    assert [c.token_ids for c in done] == [w["token_ids"] for w in want]
    assert [c.text for c in done] == [w["text"] for w in want]
    for i in range(3):
        assert [t for o in streamed if o.index == i for t in o.token_ids] == want[i]["token_ids"]
    assert sum(o.finished for o in streamed) == 3 and streamed[-1].finished
