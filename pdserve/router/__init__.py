"""The router: routes requests to prefill and decode workers, serves clients over ZeroMQ and HTTP (OpenAI), and runs deployments; one sub-package per concern (docs/architecture.md)."""
