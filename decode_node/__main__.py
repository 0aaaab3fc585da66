"""`python -m decode_node ...` is `pdserve worker decode ...`."""
import sys

from common.cli import main

sys.exit(main(["worker", "decode", *sys.argv[1:]]))
