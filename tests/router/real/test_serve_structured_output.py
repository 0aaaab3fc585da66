"""Structured output through `pdserve serve` 1P+1D on the real default model, driven by
the official openai client: the prefill worker masks the first token, the decode worker
continues the same grammar. response_format json_schema / json_object and vLLM's
structured_outputs (choice, regex) give outputs that parse, validate and match; plain
requests served beside constrained ones keep their text; a spec that does not compile
is a 400 naming the field; response_format text changes nothing."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.support.serving import served_model

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]
PLAIN = "The three primary colors are"


_model = served_model


def _schema_chat(client, **kw):
    return client.chat.completions.create(
        model=_model(client), messages=ASK, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        **kw)


def test_json_schema_chat_validates_streamed_or_not(client):
    for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 11}):
        res = _schema_chat(client, **kw)
        assert res.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(res.choices[0].message.content), PERSON)
    text, reason = [], None
    for chunk in _schema_chat(client, temperature=0, stream=True):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            reason = c.finish_reason or reason
    assert reason == "stop"
    assert "".join(text) == _schema_chat(client, temperature=0).choices[0].message.content


def test_json_object_and_structured_outputs_choice_and_regex(client):
    res = client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=80, temperature=0,
                                         response_format={"type": "json_object"})
    assert res.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(res.choices[0].message.content), dict)
    res = client.completions.create(model=_model(client), prompt="The capital of France is", max_tokens=10,
                                    temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"choice": ["Paris", "Berlin", "Rome"]}})
    assert res.choices[0].text in ("Paris", "Berlin", "Rome") and res.choices[0].finish_reason == "stop"
    res = client.completions.create(model=_model(client), prompt="Today's date is", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", res.choices[0].text) and res.choices[0].finish_reason == "stop"


def test_plain_requests_beside_constrained_ones_keep_their_text(client):
    def plain():
        return client.completions.create(model=_model(client), prompt=PLAIN, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    alone = plain()
    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(_schema_chat, client, temperature=0.8, seed=i) for i in range(3)]
        plains = [pool.submit(plain) for _ in range(3)]
        for f in constrained:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), PERSON)
        assert [f.result() for f in plains] == [alone] * 3


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_a_spec_that_does_not_compile_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_response_format_text_is_plain(client):
    kw = dict(model=_model(client), messages=ASK, max_tokens=12, temperature=0)
    assert client.chat.completions.create(**kw, response_format={"type": "text"}).choices[0].message.content == \
        client.chat.completions.create(**kw).choices[0].message.content
