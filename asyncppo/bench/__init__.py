"""``asyncppo bench``: a registry of benchmarks, each run writing one JSON result, and docs/benchmarks.md rendered
from the committed results.

registry.py (what each benchmark asks and must show), result.py (the JSON schema and the verdict), driver.py (runs
a benchmark's seeds), quick.py (the reduced rerun beside the committed figures), render.py (the page), command.py
(the command line); the other modules are the runners, the measurement code the old scripts held. Only cli.py
imports this package (an import-linter contract): nothing in a run depends on the benchmarks.
"""
