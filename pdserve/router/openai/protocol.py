"""OpenAI-compatible request bodies, validated with pydantic at the HTTP edge.

As OpenAI and vLLM: an explicit `null` means the field's default, and a field this
server does not know is ignored (the server logs its name once; `unknown_fields`). A
field it knows but cannot honour is refused by name (`unsupported`)."""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from pdserve.common.sampling_params import MAX_LOGPROBS, StructuredOutput, prompt_logprobs_problem


class _NullIsDefault(BaseModel):
    """A body whose `null` fields take their defaults (OpenAI SDKs send explicit nulls)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_NullIsDefault):
    include_usage: StrictBool = False


class _Common(_NullIsDefault):
    # unknown fields are kept aside (model_extra) so the server can log them, then ignored
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None)
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    top_k: StrictInt = -1
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    return_timeline: StrictBool = False
    user: str | None = None
    # sampling and stop controls as vLLM's OpenAI server takes them; null means the default
    # (`sampling_fields` maps them; SamplingParams.validate checks their ranges)
    min_p: StrictFloat | StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    repetition_penalty: StrictFloat | StrictInt | None = None
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    logit_bias: dict[int, StrictFloat | StrictInt] | None = None  # JSON keys are token ids as strings
    # structured output (`structured_output` reads both): OpenAI's response_format and vLLM's field
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: each prompt token's logprob and the n most likely there (not with stream)
    prompt_logprobs: StrictInt | None = None  # -1 (vLLM: the whole vocabulary) refused, saying why

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, n: int | None) -> int | None:
        if n is not None and (problem := prompt_logprobs_problem(n)):
            raise PydanticCustomError("prompt_logprobs", problem)
        return n
    # OpenAI parameters pdserve does not implement: declared so that a request asking for
    # them is refused (unsupported()) instead of silently served without them
    echo: Any = None  # served by completions (vLLM's chat echo, the last message again, is not)
    best_of: Any = None
    suffix: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    SERVED: ClassVar[frozenset[str]] = frozenset()  # of those, the ones this endpoint serves after all

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens; None: the endpoint's default."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# value(s) of an unsupported parameter that ask for nothing beyond what pdserve does
_HARMLESS: dict[str, tuple] = {
    "echo": (False,), "best_of": (1,), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
}


SAMPLING_FIELDS = ("min_p", "stop_token_ids", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")


def sampling_fields(body: _Common) -> dict[str, Any]:
    """The body's SamplingParams fields beyond the basic ones, those it set (null or
    left out: the default); logit_bias as the (id, bias) pairs SamplingParams holds."""
    out = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    if "logit_bias" in out:
        out["logit_bias"] = tuple(sorted((t, float(b)) for t, b in out["logit_bias"].items()))
    return out


class StructuredOutputError(ValueError):
    """The body's structured output request cannot be served; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# vLLM's structured_outputs keys -> our kinds; a key given as null is left out
_VLLM_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def structured_output(body: _Common, check: bool = False) -> StructuredOutput | None:
    """The body's output constraint (response_format or structured_outputs), or None;
    StructuredOutputError naming the field when it is malformed or (with `check`) does
    not compile."""
    so, param = _structured_output(body)
    if so is not None and check:
        from pdserve.common.engine.grammar import GrammarError, check as compile_check  # xgrammar: only when asked
        try:
            so.validate()
            compile_check(so)
        except (GrammarError, ValueError) as e:
            raise StructuredOutputError(param, f"{param} does not compile: {e}") from None
    return so


def _structured_output(body: _Common) -> tuple[StructuredOutput | None, str]:
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.get("type") != "text" and so:
        raise StructuredOutputError("structured_outputs", "give response_format or structured_outputs, not both")
    if rf is not None:
        kind = rf.get("type")
        if kind == "text":
            return None, ""
        if kind == "json_object":
            return StructuredOutput("json_object"), "response_format"
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise StructuredOutputError("response_format.json_schema",
                                            "response_format.json_schema must be an object with a schema")
            schema = spec.get("schema", spec.get("json_schema"))
            if schema is None:
                return StructuredOutput("json_object"), "response_format"
            if not isinstance(schema, dict):
                raise StructuredOutputError("response_format.json_schema.schema", "the schema must be a JSON object")
            return StructuredOutput("json", json.dumps(schema)), "response_format.json_schema.schema"
        raise StructuredOutputError("response_format.type", f"response_format.type must be text, json_object or "
                                                            f"json_schema, got {str(kind)[:40]!r}")
    given = {k: v for k, v in (so or {}).items() if v is not None and v is not False}
    if not given:
        return None, ""
    unknown = sorted(set(given) - set(_VLLM_KINDS))
    if unknown:
        raise StructuredOutputError(f"structured_outputs.{unknown[0]}",
                                    f"structured_outputs.{unknown[0]} is not supported by this server; "
                                    f"give one of {', '.join(_VLLM_KINDS)}")
    if len(given) != 1:
        raise StructuredOutputError("structured_outputs", f"structured_outputs takes one constraint, got "
                                                          f"{', '.join(sorted(given))}")
    (key, value), = given.items()
    param = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(param, f"{param} is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise StructuredOutputError(param, f"{param} must be a JSON schema object")
        return StructuredOutput("json", json.dumps(value)), param
    if key == "json_object":
        return StructuredOutput("json_object"), param
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise StructuredOutputError(param, f"{param} must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", json.dumps(value)), param
    if not isinstance(value, str) or not value:
        raise StructuredOutputError(param, f"{param} must be a non-empty string")
    return StructuredOutput(_VLLM_KINDS[key], value), param


def unsupported(body: _Common) -> str | None:
    """The first parameter the body sets to something pdserve cannot honour, or None."""
    for name, harmless in _HARMLESS.items():
        if name in body.SERVED:
            continue
        value = getattr(body, name)
        if value is not None and not any(value == ok and isinstance(value, bool) == isinstance(ok, bool)
                                         for ok in harmless):
            return name
    return None


def unknown_fields(body: BaseModel) -> list[str]:
    """The names of the fields the body carried that no model here declares."""
    return sorted(body.model_extra or ())


class CompletionBody(_Common):
    # one prompt (text or token ids) or several (a choice each, `index` in this order)
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    add_special_tokens: StrictBool = True  # vLLM: the tokenizer's BOS / post-processor applies
    # the legacy form: the sampled token's logprob and the `logprobs` most likely per token
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False  # the prompt comes first in the text (and in logprobs, when asked)
    SERVED: ClassVar[frozenset[str]] = frozenset({"echo"})

    def num_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: None when not asked."""
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """`SamplingParams.prompt_logprobs`, as vLLM: `prompt_logprobs`, else with echo the
        `logprobs` (the echoed prompt's logprobs). Echo without either and max_tokens 0
        asks for 0: a request that samples nothing must compute something."""
        if self.prompt_logprobs is not None or not self.echo:
            return self.prompt_logprobs
        return self.logprobs if self.logprobs is not None else (0 if self.requested_max_tokens() == 0 else None)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):  # [] too: one empty prompt, which the router refuses
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    """One part of a message's `content` list; only `text` parts can be served."""

    model_config = ConfigDict(extra="allow")  # image_url, input_audio, ...: refused by type, not by shape
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCallParam(BaseModel):
    """A call in an assistant message's `tool_calls` (router/openai/tools.py renders it)."""
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (router/openai/tools.py checks it compiles)
    strict: StrictBool | None = None


class ToolParam(BaseModel):
    """One entry of a chat request's `tools`."""
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant: the calls it made
    tool_call_id: StrictStr | None = None  # tool: the call this answers
    reasoning_content: StrictStr | None = None  # assistant: its reasoning (Qwen3's template renders it)

    def text(self) -> str:
        """The content as one string: text parts joined with newlines (as vLLM renders
        them for a string-content template). ValueError names a part that is not text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part of type {part.type!r} is not supported by this server "
                                 f"(text only): send text parts or a string")
            if part.text is None:
                raise ValueError("a content part of type 'text' needs its 'text'")
        return "\n".join(part.text or "" for part in self.content)


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: StrictBool = False  # vLLM: the chat template carries the BOS
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: StrictBool = False  # the sampled token's logprob, and `top_logprobs` most likely, per token
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # router/openai/tools.py checks and plans them; tool_choice's forms are checked there
    tools: list[ToolParam] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    SERVED: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice"})

    @model_validator(mode="before")
    @classmethod
    def _one_ending(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("continue_final_message") is True \
                and data.get("add_generation_prompt") is True:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return data

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatBody":
        if self.top_logprobs and not self.logprobs:  # OpenAI's and vLLM's rule
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def num_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: None when not asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


class TokenizeBody(_NullIsDefault):
    """`POST /tokenize` (vLLM's shape): a prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None  # messages only: rendered by the template, as a chat would

    @model_validator(mode="after")
    def _one_form(self) -> "TokenizeBody":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeBody(_NullIsDefault):
    """`POST /detokenize`: token ids to text."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[StrictInt]
