"""`python -m benchmarks.compare`: see benchmarks/compare/run.py."""
import sys

from benchmarks.compare.run import main

sys.exit(main())
