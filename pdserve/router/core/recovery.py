"""What the router does when a request's worker fails: pure decisions over plain data,
used by `Router.generate` (router/core/router.py). docs/reliability.md has the whole matrix.

- Nothing streamed yet (the prefill worker died, the transfer was lost, late, short or
  corrupt, the decode worker died before its first token): the request is routed again
  and prefilled from scratch, away from the worker that failed.
- Tokens already streamed (the decode worker died mid-decode): the request resumes on
  another decode worker with prompt = prompt + tokens streamed so far and max_tokens
  reduced by as many; the client's stream goes on from the next token, nothing repeated,
  nothing dropped. Greedy output equals the uninterrupted run; seeded random sampling
  restarts its generator from the seed at the resume point (a different, still
  reproducible stream).

Each request is retried at most `RouterConfig.retries` times; then the client gets the
last error."""
from __future__ import annotations

import dataclasses

from pdserve.common.hashing import block_hashes
from pdserve.common.wire.messages import ErrorReply
from pdserve.common.sampling_params import SamplingParams

# error codes a worker (or the router's liveness checks) report for a failure that another
# worker may not have: everything else (bad input, limits) would fail the same way again
RETRYABLE = frozenset({"worker_failed", "transfer_error", "transfer_timeout", "worker_draining"})


def retryable(err: ErrorReply, attempts_done: int, max_retries: int) -> bool:
    return err.code in RETRYABLE and attempts_done < max_retries


def resume_prompt(prompt_ids: list[int], output_ids: list[int], block_size: int) -> tuple[list[int], list[int]]:
    """The token ids (and their block hashes) a resumed attempt prefills: prompt + every
    token the client has been sent."""
    ids = list(prompt_ids) + list(output_ids)
    return ids, block_hashes(ids, block_size)


def resume_params(params: SamplingParams, num_streamed: int) -> SamplingParams:
    """The sampling parameters of a resumed attempt: as many tokens fewer, and no prompt
    logprobs once tokens were streamed (they went with the first)."""
    if not num_streamed:
        return params
    return dataclasses.replace(params, max_tokens=params.max_tokens - num_streamed, prompt_logprobs=None)


def attempt_id(request_id: str, attempt: int) -> str:
    """The id an attempt travels under: a late reply to an earlier attempt can never be
    taken for this one's, and a worker that still holds the old id does not refuse it."""
    return request_id if attempt == 0 else f"{request_id}~retry{attempt}"
