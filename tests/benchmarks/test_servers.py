"""benchmarks/harness/servers.py: a benchmark stopped by SIGTERM stops the servers it started (they
run in sessions of their own, so the signal does not reach them)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_to_a_benchmark_stops_its_servers(tmp_path):
    pid_file = tmp_path / "server.pid"
    bench = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from benchmarks.harness.servers import Server
        server = Server("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], {{}},
                        __import__("pathlib").Path({str(tmp_path / "server.log")!r}))
        open({str(pid_file)!r}, "w").write(str(server.proc.pid))
        try:
            time.sleep(120)
        finally:
            server.stop()
    """)
    proc = subprocess.Popen([sys.executable, "-c", bench])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.is_file() and pid_file.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the benchmark did not start its server"
            time.sleep(0.05)
        server = psutil.Process(int(pid_file.read_text()))
        assert server.is_running()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid_file.is_file() and pid_file.read_text():
            try:
                psutil.Process(int(pid_file.read_text())).kill()
            except psutil.Error:
                pass
