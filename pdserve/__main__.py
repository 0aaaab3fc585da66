"""`python -m pdserve`: the `pdserve` command line."""
import sys

from pdserve.router.cli.main import main

sys.exit(main())
