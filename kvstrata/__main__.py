"""`python -m kvstrata ...`: the same command line as `kvstrata ...`."""
import sys

from kvstrata.cli import main

sys.exit(main())
