"""``asyncppo selftest``: one command that measures what only a GPU can show, on whatever devices it finds.

A ladder of rungs (:mod:`asyncppo.selftest.rungs`), each reported as passed with figures, failed with the error, or
skipped with the reason, written as JSON and as a markdown table ready for docs/benchmarks.md. It runs on a bare GPU
machine (torch, transformers, msgpack; no vLLM, Ray, pyzmq or Hydra): nothing here imports those at module import,
and the rungs that need them say so and are skipped. ``--device cpu`` runs the same ladder at tiny sizes, which is
how CI keeps the command from rotting.
"""
