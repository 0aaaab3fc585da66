"""benchmarks.decode: see benchmarks/__init__.py."""
