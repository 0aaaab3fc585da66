"""OpenAI-compatible request bodies, validated with pydantic at the HTTP edge."""
from __future__ import annotations

from typing import Literal

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


class CompletionBody(_Common):
    prompt: str | list[StrictInt] | list[str]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
