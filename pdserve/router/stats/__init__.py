"""Latency and SLO statistics over per-request timings: TTFT/TPOT/ITL/E2E, attainment, goodput (used by bench, simulate and the planner)."""
