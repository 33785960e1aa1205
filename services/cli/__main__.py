"""`python -m services.cli` runs the squall command line, as `python -m services` does."""

import sys

from services.cli import main

sys.exit(main())
