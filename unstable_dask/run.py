"""`python -m unstable_dask.run ...`: the command line (cli.py) under the name users type."""
import sys

from unstable_dask.cli import main

if __name__ == "__main__":
    sys.exit(main())
