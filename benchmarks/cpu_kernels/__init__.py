"""benchmarks.cpu_kernels: see benchmarks/__init__.py."""
