"""Growing and shrinking worker pools: the control API, its client, the pool launchers (local and Ray) and the supervisor of worker processes."""
