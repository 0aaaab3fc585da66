"""The router's /metrics carry its own process figures (`process_cpu_seconds_total` & co.),
what `pdserve simulate --host-cpu-per-token-ms` is read from (docs/slo.md "Simulator")."""
from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.core.metrics import RouterMetrics


def _cpu_s(m: RouterMetrics) -> float:
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    return fams["process_cpu_seconds"].samples[0].value


def test_router_metrics_report_this_process_cpu():
    m = RouterMetrics()
    before = _cpu_s(m)
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # CPU spent in this process
        sum(range(10_000))
    assert _cpu_s(m) - before >= 0.2
