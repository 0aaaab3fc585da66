"""The router itself: its config, requests, worker registry and links, routing policy, recovery decisions, metrics and the ZeroMQ front end."""
