"""Prometheus metrics of the router: requests, TTFT/TPOT/E2E histograms, tokens,
per-worker load, prefix-cache hit rate (routing view and workers' own counters), KV
transfer bytes, the router process's own CPU and memory (`process_*`). The ones vLLM
also exports come under vLLM's names too (`vllm:` prefix, a `model_name` label), fed by
the same observations, so dashboards made for vLLM work."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics, \
    generate_latest

from pdserve.common.wire.messages import WorkerStatus

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    """Owns one CollectorRegistry (not the process-global one) and the last load each
    live worker reported (what the deployment-wide vLLM gauges sum)."""

    def __init__(self, model_name: str = "") -> None:
        disable_created_metrics()  # no *_created series: they only clutter the text output
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total & co.: the router's own CPU (docs/slo.md "Simulator")
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
        self.pool_workers = Gauge("pdserve_pool_workers", "Workers by role and state (serving, draining, "
                                  "exiting, dead)", ["role", "state"], registry=r)
        self.worker_deaths = Counter("pdserve_worker_deaths", "Workers found dead, by how", ["how"], registry=r)
        self.degraded_requests = Counter("pdserve_degraded_requests", "Requests served in a degraded mode, by "
                                         "reason: no_prefill (prefilled on a decode worker for want of a prefill "
                                         "worker), held (waited for a worker to register)", ["reason"], registry=r)
        self.degraded = Gauge("pdserve_degraded", "1 while prompts are prefilled on decode workers for want of a "
                              "live prefill worker, else 0 (/health: status degraded)", registry=r)
        self.unavailable = Gauge("pdserve_unavailable", "1 while no live worker can serve a request (requests are "
                                 "held, then refused with 503), else 0", registry=r)
        self.held = Gauge("pdserve_requests_held", "Requests waiting now for a worker to register", registry=r)
        self.disagg_decisions = Counter("pdserve_disagg_decisions", "Prefill + decode routing: prompts sent via the "
                                        "prefill worker (disagg) or prefilled on the decode worker (local), by reason",
                                        ["decision", "reason"], registry=r)
        self._vllm(r, model_name)
        self._load: dict[str, WorkerStatus] = {}  # worker id -> its last status
        self._pool_labels: set[tuple[str, str]] = set()  # (role, state) pairs reported so far

    def _vllm(self, r: CollectorRegistry, model_name: str) -> None:
        """vLLM's names for the same series (docs/metrics of vLLM): one child per metric,
        labelled with the served model."""
        m = ["model_name"]

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, m, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.v_ttft = hist("vllm:time_to_first_token_seconds", "Time to first token")
        # the router observes each request's mean time per output token after the first
        self.v_tpot = [hist("vllm:time_per_output_token_seconds", "Time per output token after the first"),
                       hist("vllm:inter_token_latency_seconds", "Time per output token after the first "
                            "(a request's mean)"),
                       hist("vllm:request_time_per_output_token_seconds", "A request's mean time per output token")]
        self.v_e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency")
        self.v_prompt = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", m, registry=r).labels(
            model_name)
        self.v_generation = Counter("vllm:generation_tokens", "Output tokens of finished requests", m,
                                    registry=r).labels(model_name)
        self.v_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                 m + ["finished_reason"], registry=r)
        self.v_model = model_name
        self.v_running = Gauge("vllm:num_requests_running", "Requests running on the workers (summed)", m,
                               registry=r).labels(model_name)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting on the workers (summed)", m,
                               registry=r).labels(model_name)
        self.v_kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of the decode-side KV blocks in use (1 = all)",
                                m, registry=r).labels(model_name)
        # speculative decoding (docs/speculative.md), counted from the workers' step outputs
        self.v_spec_drafts = Counter("vllm:spec_decode_num_drafts", "Verifications of draft tokens", m,
                                     registry=r).labels(model_name)
        self.v_spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", m,
                                           registry=r).labels(model_name)
        self.v_spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", m,
                                       registry=r).labels(model_name)
        self.v_spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by their position in the draft", m + ["position"],
                                      registry=r)

    def _sum_load(self) -> None:
        loads = self._load.values()
        self.v_running.set(sum(s.running for s in loads))
        self.v_waiting.set(sum(s.waiting for s in loads))
        kv = [s for s in loads if s.role in ("decode", "colocated")]  # where a request's KV lives to its end
        total = sum(s.total_blocks for s in kv)
        self.v_kv_usage.set(1 - sum(s.free_blocks for s in kv) / total if total else 0.0)

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
        self._load[s.worker_id] = s
        self._sum_load()

    def forget_worker(self, worker_id: str, role: str) -> None:
        """A dead worker leaves /metrics: its gauges would otherwise report its last load forever."""
        for g in (self.w_waiting, self.w_running, self.w_free, self.w_total, self.w_hit_rate, self.w_kv_bytes):
            try:
                g.remove(worker_id, role)
            except KeyError:
                pass
        self._load.pop(worker_id, None)
        self._sum_load()

    def pools(self, counts: dict[tuple[str, str], int]) -> None:
        """The pools as they are now: every (role, state) seen so far, 0 where none is left."""
        self._pool_labels.update(counts)
        for role, state in self._pool_labels:
            self.pool_workers.labels(role, state).set(counts.get((role, state), 0))

    def serving_state(self, state: str) -> None:
        """The deployment's serving state (router/core/availability.py: ok, degraded, unavailable)."""
        self.degraded.set(state == "degraded")
        self.unavailable.set(state == "unavailable")

    def routed_prefix(self, hashes: list[int], cached: set[int]) -> None:
        from pdserve.router.core.policy import prefix_overlap
        self.routed_blocks.inc(len(hashes))
        self.routed_hits.inc(prefix_overlap(hashes, cached))

    def request_done(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        reason = {"stop": "stop", "length": "length", "aborted": "abort"}.get(outcome)
        if reason is not None:  # vLLM counts finished requests only, errors apart
            self.v_success.labels(self.v_model, reason).inc()

    def ttft(self, seconds: float) -> None:
        self.ttft_h.observe(seconds)
        self.v_ttft.observe(seconds)

    def tpot(self, seconds: float) -> None:
        self.tpot_h.observe(seconds)
        for h in self.v_tpot:
            h.observe(seconds)

    def e2e(self, seconds: float) -> None:
        self.e2e_h.observe(seconds)
        self.v_e2e.observe(seconds)

    def tokens(self, prompt: int, output: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.output_tokens.inc(output)
        self.v_prompt.inc(prompt)
        self.v_generation.inc(output)

    def spec_decode(self, num_draft_tokens: list[int], num_accepted_tokens: list[int]) -> None:
        """A step output's verifications: each one's draft tokens and how many were accepted."""
        self.v_spec_drafts.inc(len(num_draft_tokens))
        self.v_spec_draft_tokens.inc(sum(num_draft_tokens))
        self.v_spec_accepted.inc(sum(num_accepted_tokens))
        for accepted in num_accepted_tokens:
            for pos in range(accepted):
                self.v_spec_per_pos.labels(self.v_model, str(pos)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
