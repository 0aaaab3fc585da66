"""Assembling a request's final output from its streamed pieces: the one place that says
how streamed deltas become the whole answer, for the HTTP, ZeroMQ and Python clients.
Torch-free (clients import it)."""
from __future__ import annotations

from typing import Iterable

from pdserve.common.wire.messages import TokenOutput


def merge_outputs(outs: Iterable[TokenOutput]) -> TokenOutput:
    """One TokenOutput holding every token and the concatenated text of `outs` (in order);
    finish state, counts and timeline come from the last. The router's detokenizer makes
    the concatenation equal the non-streamed text, so this never re-decodes."""
    outs = list(outs)
    if not outs:
        raise ValueError("merge_outputs needs at least one output")
    last = outs[-1]
    return TokenOutput(request_id=last.request_id, token_ids=[t for o in outs for t in o.token_ids],
                       text="".join(o.text for o in outs), finished=last.finished,
                       finish_reason=last.finish_reason, num_prompt_tokens=last.num_prompt_tokens,
                       num_cached_tokens=last.num_cached_tokens, timeline=last.timeline,
                       logprobs=[lp for o in outs for lp in o.logprobs or ()] if any(o.logprobs for o in outs) else None,
                       index=last.index,
                       prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None))


def usage(out: TokenOutput) -> dict[str, int]:
    """OpenAI `usage` of a merged (final) output."""
    n_out = len(out.token_ids)
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": n_out,
            "total_tokens": out.num_prompt_tokens + n_out}


def openai_usage(outs: Iterable[TokenOutput]) -> dict:
    """OpenAI `usage` of one or more merged (final) outputs (a completion with several
    prompts sums them; the n choices of one request count its prompt once, as vLLM), with
    `prompt_tokens_details.cached_tokens`: the prompt tokens the serving worker found in
    its prefix cache."""
    outs = list(outs)
    prompts = {o.request_id: o for o in outs}.values()  # one per request
    n_prompt = sum(o.num_prompt_tokens for o in prompts)
    n_out = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in prompts)}}
