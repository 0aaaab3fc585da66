"""What crosses a socket: the typed, versioned messages and their codec, the deployment's
authentication, and the ZeroMQ transport wrappers."""
