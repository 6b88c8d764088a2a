"""Tests outside tests/e2e that are too slow for the fast tier: marked ``slow`` by tests/conftest.py.

Measured with ``pytest --durations=0`` over the whole suite on the 2-core box (shared, so times were inflated about
1.5-2x); a test goes here when its setup + call took more than SLOW_SECONDS, so that ``pytest -m "not slow"`` stays
under 5 minutes. Keyed by file name, then test function name (every parametrisation of it).
"""

SLOW_SECONDS = 5.0

MEASURED_SLOW: dict[str, frozenset[str]] = {
}
