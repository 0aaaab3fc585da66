"""`--planner-latency-models auto`: the one-host planner's two latency models measured on
this machine at start-up, once per model, engine options and machine.

The layouts the planner weighs are one worker on all `--planner-host-cores` threads and
1P+1D on half of them each; each needs a latency model of the deployment's own engine at
that thread count (docs/slo.md "The SLO planner"). `serve` runs `pdserve profile` for each,
in a child process before any worker starts (the profile has the cores to itself), and keeps
the files under $PDSERVE_CACHE/latency_models (default ~/.cache/pdserve), keyed by what
decides the figures: the model folder's files (names, sizes, mtimes), the engine options
with the thread count, the transfer backend, the CPU, and the torch and pdserve versions. A
later `serve` with the same key reads them: ~20 s per thread count on the small qwen3 the
first time (2 cores), nothing after."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve.common.config import ConfigError
from pdserve.common.loading.default_model import cache_root
from pdserve.common.worker.spec import WorkerSpec

PROFILE_TIMEOUT_S = 900.0  # one thread count's profile; a model too big for this would not serve here either


def cache_dir() -> Path:
    return cache_root() / "latency_models"


def profile_key(spec: WorkerSpec, threads: int, kv_transfer: str) -> str:
    """What decides a profile's figures, hashed: the model's files, the engine options at
    `threads`, the transfer backend, the CPU, torch's and pdserve's versions."""
    from importlib.metadata import PackageNotFoundError, version

    import torch  # here, not at the top: the router process does not import torch until it profiles

    from pdserve.kernels.cpu_native import cpu_model
    try:
        ours = version("pdserve")
    except PackageNotFoundError:  # run from a checkout without installing
        ours = ""
    folder = Path(spec.model_dir).resolve()
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    engine = {**spec.engine.to_dict(), "num_threads": threads}
    parts = [str(folder), json.dumps(files), json.dumps(engine, sort_keys=True, default=str), kv_transfer,
             cpu_model(), torch.__version__, ours]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def profiled_models(spec: WorkerSpec, host_cores: int, kv_transfer: str = "auto",
                    log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> str:
    """The comma-joined paths of latency models of `spec`'s engine at `host_cores` threads
    and at half of them (`--planner-latency-models`), profiled where not cached. ConfigError
    with the profile's output where one fails."""
    if host_cores < 2:
        raise ConfigError("--planner-latency-models auto needs --planner-host-cores >= 2 (the layouts it prices)")
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--planner-latency-models auto: cannot make its cache {root} ({e.strerror}); "
                          "set PDSERVE_CACHE to a writable folder, or give the files") from None
    paths = []
    for threads in (host_cores, host_cores // 2):
        out = root / f"{profile_key(spec, threads, kv_transfer)}-t{threads}.json"
        if not out.is_file():
            log(f"pdserve: profiling {spec.model_dir} at {threads} thread(s) for the planner's latency models "
                f"(once for this model, engine and machine; kept in {root})")
            _profile(spec, threads, kv_transfer, out, log)
        paths.append(str(out))
    return ",".join(paths)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) in the main thread while this holds (serve's own
    handlers are not installed yet), so that `subprocess.run` kills its child and every
    `finally` runs; elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(*_: object) -> None:
        raise SystemExit(143)
    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _profile(spec: WorkerSpec, threads: int, kv_transfer: str, out: Path, log) -> None:
    """`pdserve profile` of `spec`'s engine at `threads` in a child process, written to `out` whole."""
    engine = {**spec.engine.to_dict(), "num_threads": threads}
    partial = out.with_name(f".{out.name}.{os.getpid()}")  # renamed onto `out` once whole
    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as tmp:
        options = Path(tmp) / "engine.json"
        options.write_text(json.dumps(engine))
        cmd = [sys.executable, "-m", "pdserve", "profile", spec.model_dir, "--engine-json", str(options),
               "--kv-transfer", kv_transfer, "--out", str(partial)]
        t0 = time.monotonic()
        try:
            with _sigterm_exits():  # stopped while profiling: the child killed, the partial file removed
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S)
            if done.returncode != 0:
                raise ConfigError(f"profiling for the planner's latency models failed ({' '.join(cmd[1:])}):\n"
                                  f"{done.stderr.strip()[-2000:]}")
            os.replace(partial, out)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"profiling for the planner's latency models took over {PROFILE_TIMEOUT_S:.0f} s: "
                              "give --planner-latency-models files (`pdserve profile`)") from None
        finally:
            partial.unlink(missing_ok=True)
    log(f"pdserve: latency model at {threads} thread(s) in {time.monotonic() - t0:.0f} s: {out}")
