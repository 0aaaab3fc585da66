"""Counting output tokens from an OpenAI completion stream: pdserve's token ids, or
(vLLM and other servers) text chunks fitted to the final usage chunk."""
from __future__ import annotations

from pdserve.router.stats.latency import RequestRecord
from pdserve.router.bench.runner import count_stream_tokens, fit_token_times


def _text(t: float, text: str) -> tuple[float, dict]:
    return t, {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def _usage(t: float, completion: int) -> tuple[float, dict]:
    return t, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": completion, "total_tokens": 7 + completion}}


def test_token_ids_win():
    chunks = [(1.0, {"choices": [{"text": "ab", "token_ids": [5, 6]}]}),
              (2.0, {"choices": [{"text": "", "token_ids": [7]}]}), _usage(2.1, 3)]
    assert count_stream_tokens(chunks) == [1.0, 1.0, 2.0]


def test_text_chunks_without_usage():
    chunks = [_text(1.0, "a"), _text(1.5, ""), _text(2.0, "b"), _text(3.0, "c")]
    assert count_stream_tokens(chunks) == [1.0, 2.0, 3.0]  # the empty chunk is no token


def test_usage_with_more_tokens_than_chunks():
    # vLLM: a chunk may carry several tokens
    chunks = [_text(1.0, "a"), _text(2.0, "bc"), _text(4.0, "d"), _usage(4.0, 5)]
    times = count_stream_tokens(chunks)
    assert len(times) == 5 and times[0] == 1.0 and times[-1] == 4.0
    rec = RequestRecord(0.5, token_times=times)
    # what `vllm bench serve` reports: TTFT = first chunk, TPOT = (E2E - TTFT) / (usage - 1)
    assert rec.ttft == 0.5 and rec.e2e == 3.5 and rec.tpot == (3.5 - 0.5) / 4


def test_with_usage_empty_text_chunks_are_arrivals():
    # as in `vllm bench serve`: a token whose text is empty (a special token, half a UTF-8
    # character) still arrived; the first and last chunk fix TTFT and E2E
    chunks = [_text(1.0, ""), _text(2.0, "b"), _text(3.0, ""), _usage(3.0, 3)]
    assert count_stream_tokens(chunks) == [1.0, 2.0, 3.0]


def test_usage_with_fewer_tokens_than_chunks():
    chunks = [_text(1.0, "a"), _text(2.0, "b"), _text(3.0, "c"), _usage(3.0, 2)]
    assert count_stream_tokens(chunks) == [1.0, 3.0]


def test_chat_deltas_count():
    chunks = [(1.0, {"choices": [{"delta": {"role": "assistant"}}]}), (2.0, {"choices": [{"delta": {"content": "x"}}]}),
              (3.0, {"choices": [{"delta": {"content": "y"}}]})]
    assert count_stream_tokens(chunks) == [2.0, 3.0]


def test_fit_token_times_edges():
    assert fit_token_times([], 3) == []
    assert fit_token_times([1.0, 2.0], 0) == []
    assert fit_token_times([1.0, 2.0, 3.0], 1) == [1.0]
    assert fit_token_times([1.0], 3) == [1.0, 1.0, 1.0]
