"""`pdserve simulate`: the router's routing code, the engine's schedulers and block
managers, driven by a discrete-event clock and a latency model instead of a model and
sockets (docs/slo.md, "Simulator")."""
