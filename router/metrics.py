"""Prometheus metrics of the router: requests, TTFT/TPOT/E2E histograms, tokens,
per-worker load, prefix-cache hit rate (routing view and workers' own counters), KV
transfer bytes."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from common.wire.messages import WorkerStatus

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    """Owns one CollectorRegistry (not the process-global one)."""

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: they only clutter the text output
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.ttft_h = Histogram("pdserve_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot_h = Histogram("pdserve_tpot_seconds", "Time per output token after the first",
                                buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_h = Histogram("pdserve_e2e_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.output_tokens = Counter("pdserve_output_tokens", "Output tokens of finished requests", registry=r)
        self.routed_blocks = Counter("pdserve_routed_prompt_blocks", "Cacheable prompt blocks routed", registry=r)
        self.routed_hits = Counter("pdserve_routed_prefix_hit_blocks",
                                   "Prompt blocks already in the chosen worker's prefix index", registry=r)
        labels = ["worker_id", "role"]
        self.w_waiting = Gauge("pdserve_worker_waiting", "Waiting requests", labels, registry=r)
        self.w_running = Gauge("pdserve_worker_running", "Running requests", labels, registry=r)
        self.w_free = Gauge("pdserve_worker_free_blocks", "Free KV blocks", labels, registry=r)
        self.w_total = Gauge("pdserve_worker_total_blocks", "Total KV blocks", labels, registry=r)
        self.w_hit_rate = Gauge("pdserve_worker_prefix_cache_hit_rate",
                                "Share of queried prompt blocks found in the worker's prefix cache", labels, registry=r)
        self.w_kv_bytes = Gauge("pdserve_worker_kv_transfer_bytes", "KV bytes sent by a prefill worker", labels,
                                registry=r)
        self.recoveries = Counter("pdserve_request_recoveries", "Requests re-routed after a worker failed, by kind",
                                  ["kind"], registry=r)
        self.worker_deaths = Counter("pdserve_worker_deaths", "Workers found dead, by how", ["how"], registry=r)

    def worker_status(self, s: WorkerStatus) -> None:
        lab = (s.worker_id, s.role)
        self.w_waiting.labels(*lab).set(s.waiting)
        self.w_running.labels(*lab).set(s.running)
        self.w_free.labels(*lab).set(s.free_blocks)
        self.w_total.labels(*lab).set(s.total_blocks)
        q = s.counters.get("prefix_query_blocks", 0)
        self.w_hit_rate.labels(*lab).set(s.counters.get("prefix_hit_blocks", 0) / q if q else 0.0)
        if "bytes_sent" in s.counters:
            self.w_kv_bytes.labels(*lab).set(s.counters["bytes_sent"])

    def forget_worker(self, worker_id: str, role: str) -> None:
        """A dead worker leaves /metrics: its gauges would otherwise report its last load forever."""
        for g in (self.w_waiting, self.w_running, self.w_free, self.w_total, self.w_hit_rate, self.w_kv_bytes):
            try:
                g.remove(worker_id, role)
            except KeyError:
                pass

    def routed_prefix(self, hashes: list[int], cached: set[int]) -> None:
        from router.policy import prefix_overlap
        self.routed_blocks.inc(len(hashes))
        self.routed_hits.inc(prefix_overlap(hashes, cached))

    def request_done(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def ttft(self, seconds: float) -> None:
        self.ttft_h.observe(seconds)

    def tpot(self, seconds: float) -> None:
        self.tpot_h.observe(seconds)

    def e2e(self, seconds: float) -> None:
        self.e2e_h.observe(seconds)

    def tokens(self, prompt: int, output: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.output_tokens.inc(output)

    def render(self) -> bytes:
        return generate_latest(self.registry)
