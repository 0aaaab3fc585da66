"""What the router does to a request before it routes it: the checks that need no
tokenizer (cheap enough for the event loop), then the grammar's compile check, the chat
template, the tokens and the block hashes (in the router's tokenizer pool). Pure
functions of the request, the tokenizer and the router's config."""
from __future__ import annotations

import dataclasses

from pdserve.common.hashing import block_hashes
from pdserve.common.sampling_params import SamplingParams, StructuredOutput
from pdserve.common.text.chat_template import ChatTemplateError
from pdserve.common.text.tokenizer import Tokenizer
from pdserve.common.validation import RequestError, check_chat, check_prompt_chars, check_sampling, check_text, check_token_ids
from pdserve.common.wire.messages import SubmitRequest
from pdserve.router.core.config import RouterConfig
from pdserve.router.core.requests import Prepared, RouteError


def check_request(sub: SubmitRequest, vocab_size: int, config: RouterConfig) -> SamplingParams:
    """The checks that need no tokenizer: one prompt form, sampling ranges, valid Unicode,
    the prompt's size in characters. RouteError names what is wrong."""
    given = [x is not None for x in (sub.prompt, sub.prompt_token_ids, sub.messages)]
    if sum(given) != 1:
        raise RouteError("give exactly one of prompt, prompt_token_ids or messages")
    if sub.tools is not None and sub.messages is None:
        raise RouteError("tools go with messages (a chat), not with a plain prompt")
    try:
        params = check_sampling(sub.sampling, vocab_size)
        limit = config.prompt_chars_limit
        if sub.messages is not None:
            check_chat(sub.messages, sub.tools, limit)
        elif sub.prompt is not None:
            check_prompt_chars(len(check_text(sub.prompt)), limit)
        elif len(sub.prompt_token_ids or ()) >= config.max_model_len:  # before copying a huge list
            check_token_ids(sub.prompt_token_ids or [], vocab_size, config.max_model_len)
    except RequestError as e:
        raise RouteError(str(e)) from None
    return params


def check_grammar(so: StructuredOutput) -> None:
    """RouteError unless the grammar compiles (xgrammar, cached per spec; seconds on the
    first use, so never on the event loop): no worker gets a grammar it would refuse."""
    from pdserve.common.engine.grammar import GrammarError, check  # xgrammar: only when asked
    try:
        check(so)
    except GrammarError as e:
        raise RouteError(f"sampling.structured ({so.kind}) does not compile: {e}") from None


def prompt_ids(tok: Tokenizer, sub: SubmitRequest) -> list[int]:
    """The prompt's token ids as its form and options say: messages rendered by the chat
    template, special tokens added by the form's default (vLLM's: a text prompt gets them,
    a chat does not) unless the request says. Raises what the tokenizer and template raise."""
    if sub.messages is not None:
        text = tok.apply_chat_template(sub.messages, add_generation_prompt=sub.add_generation_prompt,
                                       tools=sub.tools, continue_final_message=sub.continue_final_message,
                                       template_kwargs=sub.chat_template_kwargs)
        return tok.encode(text, add_special_tokens=sub.add_special_tokens is True)
    if sub.prompt is not None:
        return tok.encode(sub.prompt, add_special_tokens=sub.add_special_tokens is not False)
    return list(sub.prompt_token_ids or [])


def tokenize(tok: Tokenizer, sub: SubmitRequest) -> list[int]:
    """`prompt_ids`, its failures as RouteError (for /tokenize)."""
    try:
        return prompt_ids(tok, sub)
    except ChatTemplateError as e:
        raise RouteError(str(e)) from None
    except Exception as e:  # a template that fails to render on this input, a tokenizer error
        raise RouteError(f"cannot tokenize the prompt: {type(e).__name__}: {str(e)[:200]}") from None


def prepare(sub: SubmitRequest, tok: Tokenizer, config: RouterConfig, now: float) -> Prepared:
    """Validated, tokenized and hashed once, at the edge; RouteError names what is wrong.
    `max_tokens` is lowered to what fits the context (vLLM's min(max_tokens, max_model_len
    - prompt tokens)): the engine stops there anyway."""
    params = check_request(sub, tok.vocab_size, config)
    if params.structured is not None:
        check_grammar(params.structured)
    ids = tokenize(tok, sub)
    try:
        check_token_ids(ids, tok.vocab_size, config.max_model_len)
    except RequestError as e:
        raise RouteError(str(e)) from None
    room = config.max_model_len - len(ids)
    if params.max_tokens > room:
        params = dataclasses.replace(params, max_tokens=room)
    return Prepared(sub, ids, params, block_hashes(ids, config.block_size), now)
