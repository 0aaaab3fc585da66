"""The CPU allocator settings: applied on glibc, idempotent, and off when asked."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

from pdserve.common import malloc_tuning

CHECK = "from pdserve.common.malloc_tuning import keep_freed_memory; print(keep_freed_memory())"


def run_child(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_MALLOC_TUNING"}
    if env_value is not None:
        env["PDSERVE_MALLOC_TUNING"] = env_value
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_applied_on_glibc_linux_and_idempotent():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert run_child(None) == str(glibc)  # mallopt is glibc's; elsewhere it reports not applied
    assert malloc_tuning.keep_freed_memory() == glibc == malloc_tuning.keep_freed_memory()


def test_turned_off_by_env():
    assert run_child("0") == "False"
