"""The router's cost per streamed chunk of a chat answer's shaping (router/openai/chat_output.py):
plain text (no tools, no reasoning parser: the path every other request takes) against
the reasoning split and against "auto" tool calls after reasoning, side by side in one
process, taking turns.

    python -m benchmarks.serving.chat_output [--chars 8000] [--chunk 4] [--repeats 5]
        [--out results/chat_output.json]

One answer of `--chars` characters (reasoning, a sentence, then one tool call whose
arguments hold the rest) cut into `--chunk`-character deltas, each made into an SSE chunk
by `router.http_server.Envelope.chunk` as the server does. Reported: microseconds per
chunk for each mode (median of the repeats) and the ratios to plain.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

from benchmarks.harness.paths import REPO

from pdserve.common.wire.messages import TokenOutput
from pdserve.router.openai.chat_output import ChoiceOutput
from pdserve.router.openai.envelope import CHAT, Envelope
from pdserve.router.openai.tools import tool_plan


def answer(chars: int) -> str:
    head = "<think>" + "reason " * (chars // 28) + "</think>Sure, checking.<tool_call>"
    args = json.dumps({"text": "word " * max(1, (chars - len(head)) // 5)})
    return head + f'{{"name": "f", "arguments": {args}}}</tool_call>'


def run(pieces: list[str], shaping) -> float:
    """Seconds to turn every delta into a chunk."""
    env = Envelope(CHAT, "r", "m", 0.0, str, shaping=shaping)
    outs = [TokenOutput(request_id="r", token_ids=[1], text=p, finished=i == len(pieces) - 1,
                        finish_reason="stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    t = time.perf_counter()
    for out in outs:
        json.dumps(env.chunk(out))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=8000)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "results" / "chat_output.json"))
    args = ap.parse_args()
    text = answer(args.chars)
    pieces = [text[i:i + args.chunk] for i in range(0, len(text), args.chunk)]
    plan = tool_plan([{"type": "function", "function": {"name": "f"}}], "auto", None, True)
    modes = {"plain": None, "reasoning": functools.partial(ChoiceOutput, None, True, True),
             "auto_tools_and_reasoning": functools.partial(ChoiceOutput, plan, True, True)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, shaping in modes.items():
            times[mode].append(run(pieces, shaping))
    us = {m: statistics.median(t) / len(pieces) * 1e6 for m, t in times.items()}
    result = {"chars": len(text), "chunks": len(pieces), "us_per_chunk": us,
              "ratio_to_plain": {m: us[m] / us["plain"] for m in modes}}
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
