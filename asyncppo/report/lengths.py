"""The length distributions now live in :mod:`asyncppo.pipeline.lengths`; this name stays for existing callers."""

from asyncppo.pipeline.lengths import EmpiricalGroups, FixedLengths, LogNormalLengths, capped, parse_groups

__all__ = ["EmpiricalGroups", "FixedLengths", "LogNormalLengths", "capped", "parse_groups"]
