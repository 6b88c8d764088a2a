"""vLLM where vLLM is expected: a missing vLLM fails the test that needs it, loudly, instead of skipping it.

The README's install and CI both install vLLM, so a skipped vLLM case there would let a broken install pass. A machine
that knowingly has no vLLM (a laptop without the CPU wheel) sets ``ASYNCPPO_ALLOW_NO_VLLM=1`` and gets skips that
say why.
"""

from __future__ import annotations

import os

import pytest

ALLOW_VAR = "ASYNCPPO_ALLOW_NO_VLLM"


def require_vllm() -> None:
    """Return if vLLM imports; otherwise fail, or skip when ``$ASYNCPPO_ALLOW_NO_VLLM=1`` allows it."""
    try:
        import vllm  # noqa: F401  # heavy: vllm, only probed here
    except ImportError as exc:
        reason = f"vLLM cannot be imported ({exc})"
        if os.environ.get(ALLOW_VAR) == "1":
            pytest.skip(f"{reason}; skipped because {ALLOW_VAR}=1")
        pytest.fail(f"{reason}. The vLLM tests need it (install with `pip install -e .[cpu]`); "
                    f"set {ALLOW_VAR}=1 to skip them on a machine without vLLM", pytrace=False)
