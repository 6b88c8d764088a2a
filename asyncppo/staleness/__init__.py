"""Bounded staleness: admission control at the source (tickets) and the lag guard at the sink (buffer)."""

from asyncppo.staleness.buffer import BufferClosed, StalenessBuffer
from asyncppo.staleness.controller import AdmissionController, Ticket
from asyncppo.staleness.feeder import Feeder
from asyncppo.staleness.client import AdmissionClient
from asyncppo.staleness.server import AdmissionServer

__all__ = [
    "AdmissionClient",
    "AdmissionController",
    "AdmissionServer",
    "BufferClosed",
    "Feeder",
    "StalenessBuffer",
    "Ticket",
]
