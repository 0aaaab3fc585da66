"""benchmarks.routing: see benchmarks/__init__.py."""
