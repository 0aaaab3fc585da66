"""The comparison command, `python -m benchmarks.compare` (run.py): every system on one trace
(systems.py: the servers, their unloaded latency, the regimes derived from it by regimes.py),
interleaved (sweep.py), judged per regime with intervals and censored knees (judge.py);
`python -m benchmarks.compare.table` makes README's comparison table from its JSON."""
