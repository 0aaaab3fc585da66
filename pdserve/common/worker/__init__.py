"""A worker process's runtime: the poll loop and heartbeats (`base`), its config file
(`spec`), liveness checks and fault injection."""
