"""`python -m pdserve.decode_node --config FILE`: one decode or colocated worker (the launcher
writes FILE)."""
import sys

from pdserve.common.worker.spec import worker_main
from pdserve.decode_node.serve import serve

sys.exit(worker_main(sys.argv[1:], "python -m pdserve.decode_node", ("decode", "colocated"), serve))
