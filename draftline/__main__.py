"""`python -m draftline ...`: the same commands as the `draftline` console script."""

import sys

from draftline.core.cli import main

sys.exit(main())
