"""``python -m asyncppo.selftest`` is ``asyncppo selftest`` (for a machine where the console script is missing)."""

import sys

from asyncppo.cli import main

sys.exit(main(["selftest", *sys.argv[1:]]))
