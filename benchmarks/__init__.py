"""pdserve's benchmarks. The packaged ones run as modules from the repository root
(`python -m benchmarks.gpu.at_size`); the flat scripts beside them run as files."""
