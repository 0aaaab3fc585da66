"""The `pdserve` command line: one module per group of commands."""
