"""The router's pure parts of n > 1: queued worker entries are merged per choice, never
across choices, and `usage` counts a request's prompt once however many choices it has."""
from __future__ import annotations

import asyncio

from pdserve.common.wire.messages import RequestOutput, TokenOutput
from pdserve.router.core.requests import drain_outputs
from pdserve.router.core.text import openai_usage


def test_drain_merges_entries_of_one_choice_only():
    queue: asyncio.Queue = asyncio.Queue()
    for entry in (RequestOutput("a", [2], index=0), RequestOutput("a", [3], index=1), RequestOutput("a", [4], index=1),
                  RequestOutput("a", [5], index=0, finished=True)):
        queue.put_nowait(entry)
    outs = drain_outputs(queue, RequestOutput("a", [1], index=0))
    assert [(o.index, o.token_ids, o.finished) for o in outs] == [(0, [1, 2], False), (1, [3, 4], False),
                                                                   (0, [5], True)]


def test_usage_counts_each_request_prompt_once():
    def out(rid: str, index: int, n_tokens: int) -> TokenOutput:
        return TokenOutput(rid, list(range(n_tokens)), finished=True, num_prompt_tokens=10 if rid == "a" else 7,
                           num_cached_tokens=4 if rid == "a" else 0, index=index)
    usage = openai_usage([out("a", 0, 3), out("a", 1, 5), out("b", 0, 2), out("b", 1, 2)])
    assert usage == {"prompt_tokens": 17, "completion_tokens": 12, "total_tokens": 29,
                     "prompt_tokens_details": {"cached_tokens": 4}}
