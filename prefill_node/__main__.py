"""`python -m prefill_node --config FILE`: one prefill worker (the launcher writes FILE)."""
import sys

from common.worker.spec import worker_main
from prefill_node.worker import serve

sys.exit(worker_main(sys.argv[1:], "python -m prefill_node", ("prefill",), serve))
