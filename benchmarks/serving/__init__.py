"""benchmarks.serving: see benchmarks/__init__.py."""
