"""A whole deployment running: the router with its front ends and workers on this machine, or the router as a Ray actor."""
