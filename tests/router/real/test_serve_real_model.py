"""`pdserve serve` 1P+1D on the real default model's float32 conversion (`--quantization
none`: exactness is judged at float32; its quantized default against float32 by vLLM's
top-5 rule in tests/common/test_quantization.py), driven by the official openai client:
completions and chat, streamed and not, with accented and emoji prompts, equal
transformers' greedy output; streamed text == non-streamed text == decode(tokens); a stop
string that spans tokens cuts the text the same way in both."""
from __future__ import annotations

import pytest

from pdserve.common.text.tokenizer import Tokenizer
from tests.support.serving import REAL_MAX_MODEL_LEN as MAX_MODEL_LEN
from tests.support.serving import served_model

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

MAX_NEW = 12
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ACCENTS = [{"role": "system", "content": "Réponds en français. 🙂"},
           {"role": "user", "content": "Quelle est la capitale de l'Allemagne ? 🇩🇪"}]
PROMPT = "Crème brûlée, jalapeño and 🍣 are"


_model = served_model


@pytest.fixture(scope="module")
def rtok(real_model_dir) -> Tokenizer:
    return Tokenizer(real_model_dir)


def _stream_chat(client, messages, **kw):
    ids, text, reasons = [], [], []
    for chunk in client.chat.completions.create(model=_model(client), messages=messages, temperature=0, stream=True, **kw):
        for c in chunk.choices:
            ids += c.token_ids
            text.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    return ids, "".join(text), reasons[-1]


def _stream_completion(client, prompt, **kw):
    ids, text, reasons = [], [], []
    for chunk in client.completions.create(model=_model(client), prompt=prompt, temperature=0, stream=True, **kw):
        for c in chunk.choices:
            ids += c.token_ids
            text.append(c.text)
            reasons.append(c.finish_reason)
    return ids, "".join(text), reasons[-1]


def test_chat_answer(client, rtok):
    res = client.chat.completions.create(model=_model(client), messages=QUESTION, max_tokens=32, temperature=0)
    assert res.choices[0].message.content == "The capital of France is Paris."
    assert res.choices[0].finish_reason == "stop"
    n_prompt = len(rtok.encode(rtok.apply_chat_template(QUESTION)))
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (n_prompt, len(res.choices[0].token_ids))


def test_chat_non_ascii_streamed_and_not_match_transformers(client, served, rtok, hf_greedy):
    want = hf_greedy(served.model_dir, rtok.encode(rtok.apply_chat_template(ACCENTS)), MAX_NEW)
    res = client.chat.completions.create(model=_model(client), messages=ACCENTS, max_tokens=MAX_NEW, temperature=0)
    assert res.choices[0].token_ids == want
    assert res.choices[0].message.content == rtok.decode(want)
    ids, text, reason = _stream_chat(client, ACCENTS, max_tokens=MAX_NEW)
    assert (ids, text, reason) == (want, res.choices[0].message.content, res.choices[0].finish_reason)


def test_completion_non_ascii_streamed_and_not_match_transformers(client, served, rtok, hf_greedy):
    want = hf_greedy(served.model_dir, rtok.encode(PROMPT), MAX_NEW)
    res = client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
    assert res.choices[0].token_ids == want and res.choices[0].text == rtok.decode(want)
    assert res.choices[0].finish_reason == ("length" if len(want) == MAX_NEW else "stop")
    ids, text, reason = _stream_completion(client, PROMPT, max_tokens=MAX_NEW)
    assert (ids, text, reason) == (want, res.choices[0].text, res.choices[0].finish_reason)


def test_stop_string_spanning_tokens(client, served, rtok, hf_greedy):
    want = hf_greedy(served.model_dir, rtok.encode(PROMPT), MAX_NEW)
    full = rtok.decode(want)
    # a stop string made of the end of one token's text and the start of the next one's
    first = rtok.decode(want[:3])
    stop = full[len(first) - 2:len(first) + 2]
    expected = full[:full.find(stop)]
    res = client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, stop=[stop])
    assert (res.choices[0].text, res.choices[0].finish_reason) == (expected, "stop")
    _, text, reason = _stream_completion(client, PROMPT, max_tokens=MAX_NEW, stop=[stop])
    assert (text, reason) == (expected, "stop")


def test_what_agent_sdks_send(client, rtok):
    """Content as a list of text parts, explicit nulls and no max_tokens (LangChain's
    shape): the same answer as the plain string, and a chat runs to its end, past 16 tokens."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    res = client.chat.completions.create(model=_model(client), messages=parts, temperature=0, max_tokens=None,
                                         top_p=None, stop=None, seed=None)
    assert res.choices[0].message.content == "The capital of France is Paris."
    assert res.choices[0].finish_reason == "stop"
    story = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]
    res = client.chat.completions.create(model=_model(client), messages=story, temperature=0)
    n_prompt = len(rtok.encode(rtok.apply_chat_template(story)))
    assert res.usage.completion_tokens > 16, res.choices[0].message.content
    assert res.choices[0].finish_reason == "stop" or res.usage.completion_tokens == MAX_MODEL_LEN - n_prompt
    assert res.choices[0].message.content == rtok.decode(res.choices[0].token_ids)
