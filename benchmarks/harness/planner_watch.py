"""Watching a pdserve router's SLO planner from outside, through its /metrics: the planner's
decisions as they happen (`DecisionPoller`), the pools' workers by role and state (`pools`),
and waiting for the pools to hold still (`settle`)."""
from __future__ import annotations

import re
import threading
import time
import urllib.request

DECISION = re.compile(r'^pdserve_planner_decisions_total\{action="(\w+)",reason="(\w+)"\} ([\d.e+-]+)$', re.M)
POOL = re.compile(r'^pdserve_pool_workers\{role="(\w+)",state="(\w+)"\} ([\d.e+-]+)$', re.M)


class DecisionPoller:
    """Polls a server's /metrics every second; keeps (seconds since t0, action, reason)
    for each rise of a non-`none` decision count."""

    def __init__(self, url: str, t0: float) -> None:
        self.url, self.t0 = url.removesuffix("/v1") + "/metrics", t0
        self.seen: dict[tuple[str, str], float] = {}
        self.decisions: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        try:
            text = urllib.request.urlopen(self.url, timeout=5).read().decode()
        except OSError:
            return
        now = time.time() - self.t0
        for action, reason, count in DECISION.findall(text):
            key, n = (action, reason), float(count)
            if action != "none" and n > self.seen.get(key, 0.0):
                self.decisions.append({"t_s": now, "action": action, "reason": reason})
            self.seen[key] = n

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        self.poll()
        return self.decisions

    def since_now(self) -> "DecisionPoller":
        """Count only the decisions made from now on."""
        self.poll()
        self.decisions.clear()
        return self


def pools(url: str) -> dict[str, int]:
    """Workers per `role/state` from a pdserve router's /metrics."""
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=5).read().decode()
    return {f"{role}/{state}": int(float(n)) for role, state, n in POOL.findall(text) if float(n)}


def settle(url: str, timeout_s: float = 120.0, still_s: float = 5.0) -> dict[str, int]:
    """Wait until no worker is starting, draining or exiting and the pools hold for `still_s`."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        now = pools(url)
        if now != last:
            last, since = now, time.monotonic()
        elif not any(k.endswith(("/starting", "/draining", "/exiting")) for k in now) \
                and time.monotonic() - since >= still_s:
            return now
        time.sleep(1.0)
    return last or {}
