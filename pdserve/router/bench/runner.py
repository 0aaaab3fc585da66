"""Sending a workload to a running server (HTTP or ZeroMQ) on an arrival schedule and
recording every token's arrival time on the client clock."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from pdserve.router.stats.latency import RequestRecord
from pdserve.router.bench.workloads import BenchRequest


async def _one_zmq(client, req: BenchRequest, rec: RequestRecord, temperature: float, ignore_eos: bool,
                   timeline: bool) -> None:
    async for out in client.stream(req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt,
                                   max_tokens=req.output_len, temperature=temperature, ignore_eos=ignore_eos,
                                   return_timeline=timeline):
        now = time.perf_counter()
        rec.token_times += [now] * len(out.token_ids)
        if out.finished:
            rec.timeline = out.timeline


async def _served_model(http, url: str) -> str | None:
    """The model the server names first in GET /v1/models (it refuses any other name), or
    None to leave `model` out."""
    try:
        resp = await http.get(f"{url}/models")
        return resp.json()["data"][0]["id"] if resp.status_code == 200 else None
    except Exception:  # an older or other server: send no model name
        return None


def fit_token_times(times: list[float], n: int) -> list[float]:
    """Arrival times of `n` tokens from the arrival times of the streamed text chunks that
    carried them, for a server that sends text but no token ids (vLLM, any OpenAI server).
    The first and the last chunk time are kept, so TTFT, E2E and TPOT = (E2E - TTFT) / (n - 1)
    are what `vllm bench serve` computes from the same stream and `usage.completion_tokens`;
    tokens beyond the chunk count (a chunk carried several) arrive with the last chunk, and
    surplus chunk times (should a server split one token over chunks) are dropped from the
    middle. Only the ITLs of such a request are approximate."""
    if n <= 0 or not times:
        return []
    if n >= len(times):
        return times + [times[-1]] * (n - len(times))
    return times[:1] if n == 1 else times[:n - 1] + [times[-1]]


def count_stream_tokens(chunks: list[tuple[float, dict]]) -> list[float]:
    """Token arrival times from the parsed SSE chunks of one completion stream, each with its
    client arrival time. pdserve sends every choice's `token_ids`: one time per id. Other
    servers send text only. With a final usage chunk (asked for with
    `stream_options.include_usage`), every chunk with a choice is an arrival, as in
    `vllm bench serve` (a token can decode to empty text), fitted to the usage's
    `completion_tokens`; without one, each chunk with non-empty text counts as one token."""
    times: list[float] = []
    chunk_times: list[float] = []
    text_times: list[float] = []
    has_ids = False
    completion_tokens: int | None = None
    for now, chunk in chunks:
        choices = chunk.get("choices") or []
        if choices:
            chunk_times.append(now)
        for choice in choices:
            if choice.get("token_ids") is not None:
                has_ids = True
                times += [now] * len(choice["token_ids"])
            elif choice.get("text") or (choice.get("delta") or {}).get("content"):
                text_times.append(now)
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            completion_tokens = int(usage["completion_tokens"])
    if has_ids:
        return times
    return fit_token_times(chunk_times, completion_tokens) if completion_tokens is not None else text_times


async def _one_http(http, url: str, model: str | None, req: BenchRequest, rec: RequestRecord, temperature: float,
                    ignore_eos: bool, timeline: bool) -> None:
    """One streamed request; any non-200 (a 429 included) fails it, with no retry. Output
    tokens are counted by `count_stream_tokens` (token ids if sent, else text chunks fitted
    to the final usage)."""
    body = {**({"model": model} if model else {}), "prompt": req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt,
            "max_tokens": req.output_len, "temperature": temperature, "ignore_eos": ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}, **({"return_timeline": True} if timeline else {})}
    chunks: list[tuple[float, dict]] = []
    try:
        async with http.stream("POST", f"{url}/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "server error"))
                chunks.append((time.perf_counter(), chunk))
                if chunk.get("timeline"):
                    rec.timeline = chunk["timeline"]
    finally:  # a failed stream keeps the tokens it got
        rec.token_times += count_stream_tokens(chunks)


async def run_workload(reqs: list[BenchRequest], backend: str, url: str, send_times: list[float],
                       max_concurrency: int | None = None, temperature: float = 0.0, ignore_eos: bool = True,
                       return_timeline: bool = True, warmup: Sequence[BenchRequest] = (), progress: bool = True
                       ) -> tuple[list[RequestRecord], float]:
    """Send reqs[i] at send_times[i] seconds after start; returns records and the duration
    from the first send to the last token. The `warmup` requests go first, one at a time, and
    are not recorded: they are not in `reqs` (prompts of their own, so that the measured
    requests do not find their own prefixes cached by the warm-up), and a warm-up that fails
    fails the run (a server that cannot answer one request is not measured)."""
    if backend == "zmq":
        from pdserve.router.client import AsyncClient
        client = AsyncClient(url)
        one = lambda r, rec: _one_zmq(client, r, rec, temperature, ignore_eos, return_timeline)  # noqa: E731
    elif backend == "http":
        import httpx
        client = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1024))
        model = await _served_model(client, url.rstrip("/"))
        one = lambda r, rec: _one_http(client, url.rstrip("/"), model, r, rec, temperature, ignore_eos,  # noqa: E731
                                       return_timeline)
    else:
        raise ValueError(f"backend must be 'zmq' or 'http', got {backend!r}")
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    try:
        for r in warmup:
            rec = RequestRecord(time.perf_counter())
            await one(r, rec)
            if not rec.token_times:
                raise RuntimeError("a warm-up request got no tokens")
        bar = tqdm(total=len(reqs), desc="bench", disable=not progress, dynamic_ncols=True)
        records = [RequestRecord(0.0, prompt_len=r.prompt_len) for r in reqs]
        start = time.perf_counter()

        async def send(i: int) -> None:
            delay = start + send_times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem:
                await sem.acquire()
            rec = records[i]
            rec.send_time = time.perf_counter()
            try:
                await one(reqs[i], rec)
            except Exception as e:  # a failed request is recorded, not fatal to the run
                rec.success, rec.error = False, f"{type(e).__name__}: {e}"
            finally:
                if sem:
                    sem.release()
                bar.update(1)

        await asyncio.gather(*(send(i) for i in range(len(reqs))))
        bar.close()
        end = max((r.token_times[-1] for r in records if r.token_times), default=time.perf_counter())
        return records, end - start
    finally:
        if backend == "zmq":
            await client.close()
        else:
            await client.aclose()
