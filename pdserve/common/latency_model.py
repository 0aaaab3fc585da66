"""The latency model of one deployment: prefill time against prompt tokens, decode step
time against batch size and context, KV transfer time against blocks. `pdserve profile`
measures and writes it (router/cli/profile.py); the router's cost mode of conditional
disaggregation reads it (router/core/disagg_policy.py). It is a JSON file (schema in
docs/slo.md, "The latency model"), so a profile measured elsewhere -- a GPU's -- can be
supplied as data."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.common.config import ConfigError

SCHEMA = "pdserve-latency-model/1"


@dataclass(frozen=True)
class Curve:
    """Seconds against one size (tokens, blocks): piecewise linear through the measured
    points, extended past either end along its outermost segment, never below 0."""

    points: tuple[tuple[float, float], ...]  # (size, seconds), sizes strictly increasing

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        if len(xs) < 2 or any(b <= a for a, b in zip(xs, xs[1:])):
            raise ValueError(f"a curve needs >= 2 points with strictly increasing sizes, got sizes {xs}")

    def __call__(self, x: float) -> float:
        pts = self.points
        i = 1
        while i < len(pts) - 1 and x > pts[i][0]:
            i += 1
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    @staticmethod
    def from_samples(samples: list[tuple[float, float]]) -> "Curve":
        """The median seconds of each size measured."""
        by_x: dict[float, list[float]] = {}
        for x, y in samples:
            by_x.setdefault(float(x), []).append(float(y))
        return Curve(tuple((x, float(np.median(ys))) for x, ys in sorted(by_x.items())))


@dataclass(frozen=True)
class DecodeFit:
    """One decode step of `batch` sequences whose mean context is `context` tokens:
    base_s + per_seq_s * batch + per_token_s * batch * context (weights, per-sequence
    work, attention over the KV read)."""

    base_s: float
    per_seq_s: float
    per_token_s: float

    def __call__(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        return self.base_s + self.per_seq_s * batch + self.per_token_s * batch * context

    @staticmethod
    def fit(samples: list[tuple[int, float, float]]) -> "DecodeFit":
        """Least squares of the relative error over (batch, context, seconds) samples (a
        1 ms step counts as much as a 100 ms one); a coefficient the data would make
        negative is 0 and the others are fitted again without it."""
        y = np.array([s for _, _, s in samples])
        w = 1.0 / np.maximum(y, 1e-9)
        a = np.array([[1.0, b, b * c] for b, c, _ in samples]) * w[:, None]
        y = y * w
        keep = [0, 1, 2]
        while True:
            coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
            if len(keep) == 1 or coef.min() >= 0:
                break
            del keep[int(np.argmin(coef))]
        full = [0.0, 0.0, 0.0]
        for k, c in zip(keep, coef):
            full[k] = max(0.0, float(c))
        return DecodeFit(*full)


@dataclass(frozen=True)
class LatencyModel:
    """What a deployment's steps cost, in seconds. `meta` says what was measured (model,
    device, dtype, threads, transfer backend, block size, the machine)."""

    prefill: Curve   # one prompt of n tokens (uncached) computed in one worker's steps
    decode: DecodeFit
    transfer: Curve  # n KV blocks moved from a prefill to a decode worker
    meta: dict[str, Any] = field(default_factory=dict)
    decode_samples: tuple[tuple[int, float, float], ...] = ()  # what `decode` was fitted to

    def prefill_s(self, tokens: int) -> float:
        return self.prefill(tokens) if tokens > 0 else 0.0

    def decode_step_s(self, batch: int, context: float) -> float:
        return self.decode(batch, context)

    def transfer_s(self, blocks: int) -> float:
        return self.transfer(blocks) if blocks > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "meta": self.meta,
                "prefill": {"points": [list(p) for p in self.prefill.points]},
                "decode": {"base_s": self.decode.base_s, "per_seq_s": self.decode.per_seq_s,
                           "per_token_s": self.decode.per_token_s,
                           "samples": [list(s) for s in self.decode_samples]},
                "transfer": {"points": [list(p) for p in self.transfer.points]}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @staticmethod
    def from_json(data: Any, where: str = "latency model") -> "LatencyModel":
        """ConfigError naming the part of `data` that is wrong."""
        try:
            if not isinstance(data, dict) or data.get("schema") != SCHEMA:
                raise ValueError(f"expected a JSON object with \"schema\": {SCHEMA!r}")
            d = data["decode"]
            decode = DecodeFit(*(_seconds(d[k], f"decode.{k}") for k in ("base_s", "per_seq_s", "per_token_s")))
            samples = tuple((int(b), float(c), float(s)) for b, c, s in d.get("samples", []))
            return LatencyModel(_curve(data["prefill"], "prefill"), decode, _curve(data["transfer"], "transfer"),
                                dict(data.get("meta") or {}), samples)
        except KeyError as e:
            raise ConfigError(f"{where}: missing {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None

    @staticmethod
    def load(path: str | Path) -> "LatencyModel":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read the latency model {str(path)!r}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"latency model {str(path)!r} is not JSON: {e}") from None
        return LatencyModel.from_json(data, f"latency model {str(path)!r}")


def _seconds(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {v!r}")
    return float(v)


def _curve(part: Any, name: str) -> Curve:
    points = part["points"]
    if not isinstance(points, list) or not all(isinstance(p, list) and len(p) == 2 for p in points):
        raise ValueError(f"{name}.points must be a list of [size, seconds] pairs")
    return Curve(tuple((_seconds(x, f"{name} size"), _seconds(y, f"{name} seconds")) for x, y in points))
