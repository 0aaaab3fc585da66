"""A benchmark's peer in a child process of another venv (llama.cpp through
llama-cpp-python), driven one JSON line at a time over stdin / stdout: the child prints one
line when ready and one answer per job."""
from __future__ import annotations

import json
import os
import subprocess


class JsonChild:
    """`python -c code *args` with OMP_NUM_THREADS=threads (in `cwd`, `env` added); `ask(job)` ->
    the child's answer."""

    def __init__(self, python: str, code: str, args: list[str], threads: int, cwd: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen([python, "-c", code, *args], env=env, cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the child process ended (exit {self.proc.wait()})")
        return json.loads(line)

    def ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
