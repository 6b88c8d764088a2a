"""``python -m asyncppo`` is the ``asyncppo`` command."""

import sys

from asyncppo.cli import main

sys.exit(main())
