"""`python -m prefill_node ...` is `pdserve worker prefill ...`."""
import sys

from common.cli import main

sys.exit(main(["worker", "prefill", *sys.argv[1:]]))
