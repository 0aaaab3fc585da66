"""`pdserve bench`: workloads, arrival processes, a load runner over HTTP or ZeroMQ, and plots;
the statistics are router/stats/ (vLLM's key names)."""
