"""`python -m pdserve.prefill_node --config FILE`: one prefill worker (the launcher writes FILE)."""
import sys

from pdserve.common.worker.spec import worker_main
from pdserve.prefill_node.worker import serve

sys.exit(worker_main(sys.argv[1:], "python -m pdserve.prefill_node", ("prefill",), serve))
