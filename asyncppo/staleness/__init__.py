"""Bounded staleness: admission control at the source (tickets) and the lag guard at the sink (buffer).

The names below load their modules on first use (PEP 562), so that the pure parts (``controller``, ``order``) can be
imported without ZeroMQ: the advisor's simulator replays them on machines that have no runtime installed.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "AdmissionClient": "client",
    "AdmissionController": "controller",
    "AdmissionServer": "server",
    "BufferClosed": "buffer",
    "Feeder": "feeder",
    "StalenessBuffer": "buffer",
    "Ticket": "controller",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
