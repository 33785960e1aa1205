"""`python -m squall_server.cli` runs the squall command line, as `python -m squall_server` does."""

import sys

from squall_server.cli import main

sys.exit(main())
