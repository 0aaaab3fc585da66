"""A synthetic trace whose mix shifts half-way: prompt-heavy (long prompts, short
outputs) for the first half of its duration, decode-heavy (short prompts, long outputs)
for the second. Rows are Mooncake's (`timestamp` ms, `input_length`, `output_length`,
`hash_ids`: one id per 512-token block, none shared), so `mooncake_workload` and
`pdserve bench --trace` read it as they read /work/shared/data/mooncake's traces; lengths
are in the trace's units (bench divides them by its --trace-scale). Deterministic by seed.

    python -m pdserve.router.bench.shifting_trace --out trace.jsonl [--duration-s 120] [--rate 1]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK = 512  # tokens per hash id in a Mooncake trace


@dataclass(frozen=True)
class Phase:
    """One half's mix: mean input and output lengths (trace units) and arrivals per second."""

    input_len: int
    output_len: int
    rate: float


PROMPT_HEAVY = Phase(input_len=24_576, output_len=128, rate=1.0)   # /32: 768 tokens in, 4 out
DECODE_HEAVY = Phase(input_len=2_048, output_len=2_048, rate=1.0)  # /32: 64 in, 64 out


def shifting_mix(duration_s: float, seed: int = 0, first: Phase = PROMPT_HEAVY, second: Phase = DECODE_HEAVY,
                 jitter: float = 0.2) -> list[dict]:
    """Poisson arrivals over `duration_s` seconds: `first`'s mix and rate before the half,
    `second`'s after; each length drawn uniformly within +-`jitter` of its phase's mean."""
    if duration_s <= 0 or not 0 <= jitter < 1:
        raise ValueError("duration_s must be > 0 and jitter in [0, 1)")
    if min(first.rate, second.rate) <= 0 or min(first.input_len, first.output_len, second.input_len,
                                                   second.output_len) < 1:
        raise ValueError("phase rates must be > 0 and lengths >= 1")
    rng = np.random.default_rng(seed)
    rows, t, next_id = [], 0.0, 0
    while True:
        phase = first if t < duration_s / 2 else second
        t += rng.exponential(1.0 / phase.rate)
        if t >= duration_s:
            return rows
        phase = first if t < duration_s / 2 else second
        n_in = max(1, round(phase.input_len * rng.uniform(1 - jitter, 1 + jitter)))
        n_out = max(1, round(phase.output_len * rng.uniform(1 - jitter, 1 + jitter)))
        blocks = -(-n_in // TRACE_BLOCK)
        rows.append({"timestamp": int(t * 1000), "input_length": n_in, "output_length": n_out,
                     "hash_ids": list(range(next_id, next_id + blocks))})
        next_id += blocks


def write_trace(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second, both halves")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rows = shifting_mix(a.duration_s, a.seed, Phase(PROMPT_HEAVY.input_len, PROMPT_HEAVY.output_len, a.rate),
                        Phase(DECODE_HEAVY.input_len, DECODE_HEAVY.output_len, a.rate))
    print(f"wrote {write_trace(a.out, rows)}: {len(rows)} requests over {a.duration_s:g} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
