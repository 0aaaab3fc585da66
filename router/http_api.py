"""OpenAI-compatible request bodies, validated with pydantic at the HTTP edge."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # like OpenAI: unknown fields are ignored
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
    # OpenAI parameters pdserve does not implement: declared so that a request asking for
    # them is refused (unsupported()) instead of silently served without them
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None


# value(s) of an unsupported parameter that ask for nothing beyond what pdserve does
_HARMLESS: dict[str, tuple] = {
    "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "suffix": ("",),
    "response_format": ({"type": "text"},),
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


def unsupported(body: _Common) -> str | None:
    """The first parameter the body sets to something pdserve cannot honour, or None."""
    for name, harmless in _HARMLESS.items():
        value = getattr(body, name)
        if value is not None and not any(value == ok and isinstance(value, bool) == isinstance(ok, bool)
                                         for ok in harmless):
            return name
    return None


class CompletionBody(_Common):
    prompt: str | list[StrictInt] | list[str]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
