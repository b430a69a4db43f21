"""`python -m draftline ...`: the same commands as the `draftline` console script."""

import sys

from draftline.cli import main

if __name__ == "__main__":  # not when a spawned worker (bench-serve's clients) imports this module again
    sys.exit(main())
