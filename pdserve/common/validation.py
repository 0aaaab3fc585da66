"""Checks on a request's prompt, shared by the router (the serving edge) and the engine
(the offline edge, and every worker, which serves untrusted wire input). Torch-free."""
from __future__ import annotations

import json
from typing import Any, Callable

from pdserve.common.sampling_params import SamplingParams, SamplingParamsError


class RequestError(ValueError):
    """A request cannot be served as given; the message names the value and the limit."""


def check_token_ids(token_ids: list[int], vocab_size: int, max_model_len: int) -> list[int]:
    """`token_ids` if they make a servable prompt, else RequestError saying why."""
    if not token_ids:
        raise RequestError("prompt is empty: at least one token is needed")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise RequestError(f"prompt has {len(token_ids)} tokens; max_model_len is {max_model_len}, "
                           f"so a prompt may have at most {max_model_len - 1}")
    return token_ids


def check_text(text: str, what: str = "prompt") -> str:
    """`text` if UTF-8 can carry it; RequestError for a lone surrogate (JSON's "\\ud800"),
    which the tokenizer and msgpack would otherwise meet."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} is not valid Unicode: lone surrogate at character {e.start}") from None
    return text


def check_prompt_chars(num_chars: int, max_chars: int) -> None:
    """The size cap checked before tokenizing: tokenizing costs time in proportion to the
    text, and a prompt this long could not fit max_model_len anyway (for sane limits)."""
    if num_chars > max_chars:
        raise RequestError(f"prompt has {num_chars} characters; the limit is {max_chars} "
                           f"(a prompt must also fit max_model_len in tokens)")


def prompt_token_ids(prompt: object, encode: Callable[[str], list[int]], vocab_size: int,
                     max_model_len: int) -> list[int]:
    """Token ids of a prompt given as text or ids, checked; RequestError names what is wrong."""
    if isinstance(prompt, str):
        token_ids = encode(check_text(prompt))
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_ids = list(prompt)
    else:
        raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return check_token_ids(token_ids, vocab_size, max_model_len)


def check_sampling(params: object, vocab_size: int) -> SamplingParams:
    """`params` if it is a valid SamplingParams whose token ids (stop_token_ids,
    logit_bias) are in the vocabulary; RequestError (a ValueError) otherwise."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    try:
        params.validate()
    except SamplingParamsError as e:
        raise RequestError(str(e)) from None
    bad = params.token_ids_out_of(vocab_size)
    if bad is not None:
        raise RequestError(f"token id {bad} in stop_token_ids or logit_bias is outside the vocabulary [0, {vocab_size})")
    return params


MESSAGE_TEXT_KEYS = ("role", "content", "name", "tool_call_id", "reasoning_content")


def check_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, max_chars: int) -> None:
    """RequestError unless every message has a string `role` and `content`, and beside
    them only string `name`, `tool_call_id`, `reasoning_content` and a list `tool_calls`;
    all text valid Unicode, and the whole (tool calls and tools as JSON) within `max_chars`."""
    chars = 0
    for m in messages:
        if set(m) - {*MESSAGE_TEXT_KEYS, "tool_calls"} or "role" not in m or "content" not in m:
            raise RequestError("each chat message needs 'role' and 'content', and may have only 'name', "
                               "'tool_calls', 'tool_call_id' and 'reasoning_content' beside them")
        for key in MESSAGE_TEXT_KEYS:
            if key in m:
                if not isinstance(m[key], str):
                    raise RequestError(f"message {key} must be a string")
                chars += len(check_text(m[key], f"message {key}"))
        if "tool_calls" in m:
            if not isinstance(m["tool_calls"], list) or not all(isinstance(c, dict) for c in m["tool_calls"]):
                raise RequestError("message tool_calls must be a list of objects")
            chars += len(_json_text(m["tool_calls"], "message tool_calls"))
    if tools is not None:
        chars += len(_json_text(tools, "tools"))
    check_prompt_chars(chars, max_chars)


def _json_text(value: Any, what: str) -> str:
    try:
        return check_text(json.dumps(value, ensure_ascii=False), what)
    except (TypeError, ValueError):  # bytes (msgpack bin) from a ZeroMQ client
        raise RequestError(f"{what} must be JSON data (objects, lists, strings, numbers)") from None
