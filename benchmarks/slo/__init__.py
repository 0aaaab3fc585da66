"""benchmarks.slo: see benchmarks/__init__.py."""
