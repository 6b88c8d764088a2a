"""Networks that both sides of a run hold: the env workers act with them and the learner trains them.

Why a package of its own: the learner and the rollout side may meet only through stream records and synced weights,
so a network definition both must import cannot live in either (envs/ or learner/). Modules here import torch only.
"""
