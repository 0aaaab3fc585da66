"""Starting worker processes: a deployment as data, local subprocesses and Ray actors."""
