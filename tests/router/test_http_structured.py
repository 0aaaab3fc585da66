"""The HTTP edge's structured-output mapping (router/openai/protocol.py), without a server:
OpenAI's response_format and vLLM's structured_outputs become one StructuredOutput, and
every malformed or uncompilable form is refused naming the field."""
from __future__ import annotations

import json

import pytest

from pdserve.common.sampling_params import StructuredOutput
from pdserve.router.openai.protocol import ChatBody, StructuredOutputError, structured_output

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _so(check: bool = True, **fields) -> StructuredOutput | None:
    return structured_output(ChatBody(messages=MSG, **fields), check=check)


def test_each_form_maps_to_one_structured_output():
    assert _so() is None
    assert _so(response_format={"type": "text"}) is None
    assert _so(response_format={"type": "json_object"}) == StructuredOutput("json_object")
    assert _so(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}) \
        == StructuredOutput("json", json.dumps(SCHEMA))
    assert _so(structured_outputs={"json": SCHEMA}) == StructuredOutput("json", json.dumps(SCHEMA))
    assert _so(structured_outputs={"json": json.dumps(SCHEMA)}) == StructuredOutput("json", json.dumps(SCHEMA))
    assert _so(structured_outputs={"regex": "[0-9]+", "choice": None}) == StructuredOutput("regex", "[0-9]+")
    assert _so(structured_outputs={"choice": ["a", "b"]}) == StructuredOutput("choice", '["a", "b"]')
    assert _so(structured_outputs={"grammar": 'root ::= "x"'}) == StructuredOutput("grammar", 'root ::= "x"')


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": "nope"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_a_bad_form_names_its_field(fields, param):
    with pytest.raises(StructuredOutputError) as e:
        _so(**fields)
    assert e.value.param == param
