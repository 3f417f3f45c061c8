"""`python -m mminfer ...` = the `mminfer` command (for checkouts that are not pip-installed)."""
import sys

from mminfer.cli import main

sys.exit(main())
