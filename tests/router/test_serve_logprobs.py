"""Log-probabilities through `pdserve serve` with the openai client, on 1 prefill + 1
decode worker (the first token's logprob is computed on P and travels in KVReady) and on
a colocated worker: chat and completions, streamed and not, equal to the offline
engine's (themselves checked against transformers in tests/common/test_logprobs.py)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdserve.common import LLM, SamplingParams
from tests.support.serving import CHAT, MAX_MODEL_LEN, MAX_NEW, PROMPTS, chat_ids

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")
TOP = 3


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN)

    def run(ids: list[int], top: int = TOP) -> dict:
        return llm.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=top), use_tqdm=False)[0]
    return run


@pytest.fixture(params=["pd", "colocated"])
def served(request):
    return request.getfixturevalue(request.param)


def _client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.http, api_key="unused", max_retries=0, timeout=60)


def _check_chat(content, want: dict, tok) -> None:
    assert len(content) == len(want["token_ids"])
    for entry, tid, lp in zip(content, want["token_ids"], want["logprobs"]):
        assert entry.token == tok.decode([tid], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == TOP
        assert tops == pytest.approx(lp.top_logprobs, abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i], skip_special_tokens=False)
                                                         for i in lp.top_ids]
        assert entry.token in [t.token for t in entry.top_logprobs]  # greedy: the sampled token is the top one


def test_chat_logprobs_equal_the_offline_engine(served, tok, offline):
    want = offline(chat_ids(tok, CHAT))
    res = _client(served).chat.completions.create(model="qwen3", messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                                  logprobs=True, top_logprobs=TOP)
    choice = res.choices[0]
    assert choice.token_ids == want["token_ids"]
    _check_chat(choice.logprobs.content, want, tok)  # the first entry's logprob came from P on pd


def test_chat_logprobs_streamed(served, tok, offline):
    want = offline(chat_ids(tok, CHAT))
    stream = _client(served).chat.completions.create(model="qwen3", messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                                     logprobs=True, top_logprobs=TOP, stream=True)
    content, ids = [], []
    for chunk in stream:
        for c in chunk.choices:
            ids += c.token_ids
            if c.token_ids:
                assert c.logprobs is not None and len(c.logprobs.content) == len(c.token_ids)
                content += c.logprobs.content
    assert ids == want["token_ids"]
    _check_chat(content, want, tok)


def test_chat_without_top_logprobs_has_the_sampled_tokens_only(served, tok, offline):
    want = offline(chat_ids(tok, CHAT), top=0)
    res = _client(served).chat.completions.create(model="qwen3", messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                                  logprobs=True)
    content = res.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in want["logprobs"]], abs=1e-4)
    assert all(c.top_logprobs == [] for c in content)


def test_completions_logprobs_streamed_and_not(served, tok, offline):
    prompt = PROMPTS[2]
    want = offline(tok.encode(prompt))
    oai = _client(served)
    one = oai.completions.create(model="qwen3", prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=TOP)
    lp = one.choices[0].logprobs
    strings = [tok.decode([t], skip_special_tokens=False) for t in want["token_ids"]]
    assert lp.tokens == strings
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want["logprobs"]], abs=1e-4)
    assert lp.text_offset == [sum(len(s) for s in strings[:i]) for i in range(len(strings))]
    for top, s, x in zip(lp.top_logprobs, strings, want["logprobs"]):
        assert s in top and len(top) == TOP  # greedy: the sampled token is among the top
        assert sorted(top.values(), reverse=True) == pytest.approx(x.top_logprobs, abs=1e-4)
    chunks = [c for ch in oai.completions.create(model="qwen3", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                                 logprobs=TOP, stream=True) for c in ch.choices if c.token_ids]
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
    assert [t for c in chunks for t in c.logprobs.token_logprobs] == lp.token_logprobs
    assert [t for c in chunks for t in c.logprobs.text_offset] == lp.text_offset
    assert [t for c in chunks for t in c.logprobs.top_logprobs] == lp.top_logprobs


def test_plain_requests_batched_with_logprob_requests_stay_token_exact(served):
    oai = _client(served)

    def plain(i: int) -> list[int]:
        return oai.completions.create(model="qwen3", prompt=PROMPTS[i % 3], max_tokens=MAX_NEW, temperature=0.8,
                                      seed=i).choices[0].token_ids

    def asking(i: int) -> list[int]:
        res = oai.completions.create(model="qwen3", prompt=PROMPTS[i % 3], max_tokens=MAX_NEW, temperature=0.8,
                                     seed=100 + i, logprobs=5)
        assert len(res.choices[0].logprobs.token_logprobs) == len(res.choices[0].token_ids)
        return res.choices[0].token_ids

    alone = [plain(i) for i in range(4)]
    with ThreadPoolExecutor(8) as pool:
        mixed = [pool.submit(plain, i) for i in range(4)] + [pool.submit(asking, i) for i in range(4)]
        assert [f.result() for f in mixed[:4]] == alone
        assert all(f.result() for f in mixed[4:])


@pytest.mark.parametrize("path,body,param", [
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": 3}, "logprobs"),
    ("completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
])
def test_logprobs_out_of_range_is_a_400_naming_the_field(pd, path, body, param):
    r = httpx.post(f"{pd.http}/{path}", json={"model": "qwen3", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_top_logprobs_without_logprobs_is_a_400(pd):
    r = httpx.post(f"{pd.http}/chat/completions", timeout=30,
                   json={"model": "qwen3", "max_tokens": 2, "messages": CHAT, "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]


def test_zmq_client_gets_the_same_logprobs(pd, tok, offline):
    from pdserve.router.client import Client
    ids = tok.encode(PROMPTS[0])
    want = offline(ids)
    with Client(pd.zmq, timeout_s=60) as client:
        done = client.generate(PROMPTS[0], max_tokens=MAX_NEW, temperature=0, logprobs=TOP)
        plain = client.generate(PROMPTS[0], max_tokens=MAX_NEW, temperature=0)
        streamed = list(client.stream(PROMPTS[0], max_tokens=MAX_NEW, temperature=0, logprobs=TOP))
    assert done.token_ids == want["token_ids"] and plain.logprobs is None
    assert [x.logprob for x in done.logprobs] == pytest.approx([x.logprob for x in want["logprobs"]], abs=1e-4)
    assert [x.top_ids for x in done.logprobs] == [x.top_ids for x in want["logprobs"]]
    assert [x for o in streamed for x in o.logprobs or ()] == done.logprobs
