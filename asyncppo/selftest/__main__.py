"""``python -m asyncppo.selftest`` is ``asyncppo selftest`` (for a machine where the console script is missing)."""

import argparse
import sys

from asyncppo.selftest import command

parser = argparse.ArgumentParser(prog="asyncppo")
command.add_parser(parser.add_subparsers(dest="command"))
args = parser.parse_args(["selftest", *sys.argv[1:]])
sys.exit(args.func(args))
