"""`python -m squall_server` runs the squall command line."""

import sys

from squall_server.cli import main

sys.exit(main())
