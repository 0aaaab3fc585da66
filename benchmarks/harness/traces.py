"""The Mooncake traces (/work/shared/data/mooncake, README there) and how benchmarks replay
them on small models: lengths and 512-token hash blocks scaled down, ties spread."""
from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

MOONCAKE = Path("/work/shared/data/mooncake")
CONVERSATION = MOONCAKE / "conversation_trace.jsonl"  # 12,031 requests over 3,537 s
SYNTHETIC = MOONCAKE / "synthetic_trace.jsonl"  # 3,993 requests over 1,022 s, Poisson arrivals


def spread_ties(arrivals: list[float]) -> list[float]:
    """Spread requests that share a timestamp (the trace's 3 s resolution) evenly over the
    gap to the next timestamp (the last group over the median gap); distinct timestamps stay
    where they are."""
    distinct = sorted(set(arrivals))
    gaps = [b - a for a, b in zip(distinct, distinct[1:])]
    last_gap = statistics.median(gaps) if gaps else 0.0
    nxt = {t: (distinct[i + 1] if i + 1 < len(distinct) else t + last_gap) for i, t in enumerate(distinct)}
    total = Counter(arrivals)
    seen: Counter[float] = Counter()
    out = []
    for t in arrivals:
        out.append(t + (nxt[t] - t) * seen[t] / total[t])
        seen[t] += 1
    return out
