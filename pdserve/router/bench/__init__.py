"""`pdserve bench`: workloads, arrival processes, a load runner over HTTP or ZeroMQ,
latency/SLO metrics with vLLM's key names, rate and SLO sweeps, and plots."""
