"""benchmarks.kv_transfer: see benchmarks/__init__.py."""
