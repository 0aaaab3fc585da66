"""The keys a `pdserve bench` result JSON documents (vLLM `bench serve` names), shared by
the JSON tests and the end-to-end test."""
from __future__ import annotations

SUMMARY_KEYS = {
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "slo_attainment", "request_rate",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
}
DETAIL_KEYS = {"input_lens", "output_lens", "ttfts", "tpots", "itls", "e2els", "errors", "timelines"}  # --save-detailed
