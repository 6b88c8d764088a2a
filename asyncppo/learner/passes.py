"""When a PPO step can take the proximal log-probs from its own training forwards instead of a separate no-grad pass.

Why: the decoupled loss and the rollout correction need the log-probs of the policy *before* the step (the proximal
policy). Recomputing them is a whole no-grad actor forward over the batch, a third to a half of a step's compute on
the tasks measured in docs/benchmarks.md. While a step makes only one optimizer step, the weights do not move until
that step, so every training forward of the step runs at the proximal policy and its own outputs, detached, are the
numbers the separate pass would recompute. Two cases, decided here from the config and the batch alone:

* :func:`single_pass`: one micro-batch. The whole batch's forward runs first, so anything may read the proximal
  log-probs and old values before the loss (advantages from a critic, KL in the reward, batch statistics).
* :func:`fuses_proximal`: several micro-batches. Each micro-batch's forward gives its own rows' proximal log-probs
  just before its loss, so nothing may need those of the whole batch first.

Both give the same update up to float summation order (tests/unit/test_learner.py). And :func:`trained_rows`:
rows that no actor term trains on (answers cut at the length limit under ``mask_truncated``) leave the training
forwards, and a fused step's reference forward, altogether.
"""

from __future__ import annotations

from typing import Optional

import torch

from asyncppo import algo
from asyncppo.config.schema import AlgorithmConfig
from asyncppo.learner.batch import TrainBatch


def _one_optimizer_step(alg: AlgorithmConfig, batch: TrainBatch, has_dropout: bool) -> bool:
    """One epoch over one mini-batch, with no dropout (a forward with active dropout is a sample of the policy, not
    the policy)."""
    if alg.ppo_epochs != 1 or has_dropout:
        return False
    num_groups = int(batch.group_index.max().item()) + 1
    return not 0 < alg.ppo_mini_batch_size < num_groups


def single_pass(alg: AlgorithmConfig, batch: TrainBatch, world_size: int, has_dropout: bool) -> bool:
    """True when this step makes exactly one optimizer step over one micro-batch on one rank: the training forward
    (run before the batch's targets) gives the proximal log-probs and the critic's old values. Several ranks keep
    the separate passes here: the batch's targets need every rank's rows, and their no-grad work is sharded."""
    if world_size != 1 or not _one_optimizer_step(alg, batch, has_dropout):
        return False
    if alg.max_tokens_per_micro_batch > 0:
        return int(batch.attention_mask.sum()) <= alg.max_tokens_per_micro_batch
    return alg.micro_batch_size <= 0 or alg.micro_batch_size >= batch.size


def fuses_proximal(alg: AlgorithmConfig, batch: TrainBatch, world_size: int, has_dropout: bool,
                   has_critic: bool) -> bool:
    """True when this step makes one optimizer step over several micro-batches with nothing that needs the
    proximal log-probs of the whole batch before the first loss. Ruled out: a critic (its old values feed the
    advantages), KL in the reward (it reads the proximal log-probs before the advantages), ``clip_cov`` /
    ``kl_cov`` (their token selection spans the mini-batch), and batch-normalised correction weights or a rejection
    (per-batch statistics; a rejection also changes the loss denominators). The correction's batch figures (its
    metrics) are computed after the micro-batches, from the log-probs they collected (gathered from every rank
    when the learner is sharded: ``ShardedPPOUpdate._update_mini_batch``)."""
    if has_critic or not _one_optimizer_step(alg, batch, has_dropout):
        return False
    if single_pass(alg, batch, world_size, has_dropout):
        return False
    if alg.add_token_level_kl or alg.policy_loss in algo.COV_LOSSES:
        return False
    return alg.off_policy_correction == "none" or (not alg.off_policy_normalize and alg.rejection == "none")


def trained_rows(batch: TrainBatch, has_critic: bool, world_size: int) -> Optional[torch.Tensor]:
    """The rows of ``batch`` with at least one token in its loss mask, when the others may leave the training
    forwards; None when every row must go through.

    Why: ``mask_truncated`` takes answers cut at the length limit out of every actor term (policy, entropy bonus, KL
    loss) and out of their denominators (``algo.loss_denominators`` counts a row without a loss token as no
    sequence), so such a row adds exactly zero to the loss and its gradient. On long generations it is also the
    costliest row: on ``data=long`` a cut answer is 1,028 tokens against a mean of ~100. Leaving it out changes the
    update only by float summation order. Kept when a critic trains on the whole response, and on several ranks
    (FSDP needs every rank to run the same number of micro-batches, which dropped rows would break); None too when
    no row would be left out, or no row would be left (the step then runs as before, and its zero gradient makes
    no optimizer step)."""
    if has_critic or world_size != 1 or batch.loss_mask is None:
        return None
    keep = batch.loss_mask.any(dim=-1)
    if bool(keep.all()) or not bool(keep.any()):
        return None
    return torch.nonzero(keep, as_tuple=False).squeeze(1)
