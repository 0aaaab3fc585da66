"""The row count from which another product of one weight shape beats the native one,
measured on the CPU at hand: where a linear's m rows go through torch's bf16 matmul
(oneDNN: AMX tiles or AVX512_BF16) instead of the native widened-bf16 tile
(`kernels.LinearPlan`).

Decode rows are bound by the weight stream, which the native tile reads at half the bytes
of float32; a batch of enough rows is bound by arithmetic instead, where bf16 dot products
(several times float32's FMA rate) win. Where the two meet depends on the chip, its
memory, the thread count and the shape, so it is measured, not set: both products timed
at `ROWS` rows of one weight, interleaved, the best of `REPS` each (`measure`), and the
crossover is the smallest measured count from which the candidate wins at that count and
every larger one measured (`crossover`, a pure function of the timings). Counts past the
largest measured follow its verdict. Counts are measured from the top down and stop at
the first loss: the rule never reads below it.

Results are kept per process. With ``PDSERVE_CPU_CROSSOVER_CACHE=1`` they are also kept on
disk under ``$PDSERVE_CACHE/crossover/`` (default ``~/.cache/pdserve``), in a file keyed
by the CPU's model and flags, torch's version, the thread count and the kernel build
flags, so that workers measure a shape once per machine. Off by default: a measurement
taken while other work shared the cores (a loaded 2-core VM times a 2-thread product
1000x slower now and then) would stick to every later process; measured per process, it
costs that process alone. Concurrent writers each replace the file whole; one's new entry
may be lost, and is measured again later.
``PDSERVE_CPU_<WHAT>_DOT_ROWS=N`` (say PDSERVE_CPU_BF16_DOT_ROWS=16) fixes the crossover
of every shape to N rows, ``never`` to none, without measuring (tests, experiments).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from . import cpu_native
from .atomic_file import replaced

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts timed: decode batches up to a prompt chunk's
REPS = 3  # timed calls of each product per count, after one untimed call each
NEVER = 1 << 62  # the crossover of a product that never wins: no row count reaches it
FORMAT = 1  # of the disk cache's entries: a change of `measure` or `crossover` bumps it

# {disk key: {"bf16 576x1536": rows}}: what this process measured or read
_TABLES: dict[str, dict[str, int]] = {}

Product = Callable[[torch.Tensor], object]  # x [m, k] float32 -> the product (its value unused)
Timings = Mapping[int, tuple[Sequence[float], Sequence[float]]]  # rows -> (native s, candidate s)


def wins(native: Sequence[float], candidate: Sequence[float]) -> bool:
    """Whether the candidate is faster: each side's best of its timings (interference on a
    shared machine only ever adds time)."""
    return min(candidate) < min(native)


def crossover(timings: Timings) -> int:
    """The smallest measured row count from which the candidate wins at that count and at
    every larger one measured; NEVER where it loses at the largest (or nothing was timed)."""
    best = NEVER
    for rows in sorted(timings, reverse=True):
        if not wins(*timings[rows]):
            break
        best = rows
    return best


def measure(native: Product, candidate: Product, k: int, rows: Sequence[int] = ROWS, reps: int = REPS,
            clock: Callable[[], float] = time.perf_counter) -> dict[int, tuple[list[float], list[float]]]:
    """Both products timed on random x [m, k] float32 at each count m of `rows`, the largest
    first: one untimed call each (oneDNN makes its primitive for a new shape then), then
    `reps` calls each, alternating and the order swapped every round, so that drift in the
    machine's load hits both alike. Stops after the first count the candidate loses
    (`crossover` reads nothing below it). {m: (native seconds, candidate seconds)}."""
    g = torch.Generator().manual_seed(0)
    out: dict[int, tuple[list[float], list[float]]] = {}
    for m in sorted(set(rows), reverse=True):
        x = torch.randn(m, k, generator=g)
        native(x)
        candidate(x)
        times: tuple[list[float], list[float]] = ([], [])
        for r in range(reps):
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                fn = (native, candidate)[side]
                t0 = clock()
                fn(x)
                times[side].append(clock() - t0)
        out[m] = times
        if not wins(*times):
            break
    return out


def rows_for(what: str, n: int, k: int, native: Product, candidate: Product,
             clock: Callable[[], float] = time.perf_counter) -> int:
    """The crossover of `candidate` over `native` for an [n, k] weight: the override
    PDSERVE_CPU_<WHAT>_DOT_ROWS if set, else this process's or the disk cache's entry for
    the shape, else measured now (and kept). `what` names the candidate ("bf16")."""
    forced = override(what)
    if forced is not None:
        return forced
    key = _disk_key()
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = _load(key)
    entry = f"{what} {n}x{k}"
    if entry not in table:
        timings = measure(native, candidate, k, clock=clock)
        table[entry] = crossover(timings)
        log.info("crossover %s [%d, %d] at %d threads: %s rows (best native / %s ms by rows: %s)", what, n, k,
                 torch.get_num_threads(), "never" if table[entry] == NEVER else table[entry], what,
                 {m: f"{min(a) * 1e3:.3f} / {min(b) * 1e3:.3f}" for m, (a, b) in sorted(timings.items())})
        _save(key, table)
    return table[entry]


def override(what: str) -> int | None:
    """PDSERVE_CPU_<WHAT>_DOT_ROWS as a crossover (a positive row count, or ``never``), None
    where unset. A bad value raises ValueError naming the variable."""
    name = f"PDSERVE_CPU_{what.upper()}_DOT_ROWS"
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value == "never":
        return NEVER
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: give a row count of at least 1, or 'never'")
    return int(value)


def forget() -> None:
    """Drop what this process measured or read (the disk cache stays): for tests."""
    _TABLES.clear()


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "crossover"


def _disk_key() -> str:
    """What a measurement holds for: the CPU (model and flags, as in the native build's key),
    torch (its oneDNN), the threads both products run on, the native build's extra flags."""
    facts = [cpu_native.cpu_model(), torch.__version__, str(torch.get_num_threads()),
             os.environ.get("PDSERVE_KERNEL_CFLAGS", ""), str(FORMAT)]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def _model_name() -> str:
    """The CPU's model line alone (the cache file says what it was measured on)."""
    lines = cpu_native.cpu_model().splitlines()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), lines[0])


def _on_disk() -> bool:
    return os.environ.get("PDSERVE_CPU_CROSSOVER_CACHE", "").strip() == "1"


def _load(key: str) -> dict[str, int]:
    """The disk cache's entries for `key` ({} where absent, unreadable or malformed)."""
    if not _on_disk():
        return {}
    try:
        data = json.loads((cache_dir() / f"{key}.json").read_text())
        entries = data["rows"]
        if isinstance(entries, dict) and all(isinstance(v, int) and v >= 1 for v in entries.values()):
            return dict(entries)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {}


def _save(key: str, table: dict[str, int]) -> None:
    """The table written whole in place of the file (a temp file renamed); a failure to
    write is logged and leaves the process's own table as it is."""
    if not _on_disk():
        return
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with replaced(root / f"{key}.json") as tmp, open(tmp, "w") as f:
            json.dump({"cpu": _model_name(), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "rows": table}, f, indent=1, sort_keys=True)
    except OSError as e:
        log.warning("could not write the crossover cache under %s: %s", root, e)
