"""`python -m services` runs the squall command line."""

import sys

from services.cli import main

sys.exit(main())
