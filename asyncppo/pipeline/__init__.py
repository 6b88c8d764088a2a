"""The pipeline model: a pure discrete-event model of engines, admission, learner and pushes, with its inputs.

Why its own floor: ``asyncppo advise`` (report/) and the in-run window tuner (:mod:`asyncppo.pipeline.tuner`, called
by the learner loop) must predict with one and the same code, and the learner may not import report/. So the model,
the length distributions it replays and the line fit that turns logged timings into rates live here, under both,
importing only staleness/ (the admission rules it replays) and config/ (its choices).
"""
