"""`python -m decode_node --config FILE`: one decode or colocated worker (the launcher
writes FILE)."""
import sys

from common.worker.spec import worker_main
from decode_node.worker import serve

sys.exit(worker_main(sys.argv[1:], "python -m decode_node", ("decode", "colocated"), serve))
