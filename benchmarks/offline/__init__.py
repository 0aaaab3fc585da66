"""benchmarks.offline: see benchmarks/__init__.py."""
