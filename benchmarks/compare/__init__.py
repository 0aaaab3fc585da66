"""The comparison command, `python -m benchmarks.compare` (run.py): every system on one trace,
interleaved, judged in SLO regimes derived from their unloaded latency (regimes.py, judge.py);
`python -m benchmarks.compare.table` makes README's comparison table from its JSON."""
