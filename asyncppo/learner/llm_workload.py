"""The LLM workload of the learner loop (learner/loop.py): whole groups of token sequences, trained with PPO.

What it adds to the loop: the actor, critic and reference (learner/build.py, sharded over several learner ranks when
there are several, whose followers only do what rank 0 broadcasts), a resume from a checkpoint, dynamic sampling
(learner/dynamic_sampling.py: groups whose rewards are all equal are skipped and their tickets released), the content
validator at the door with the record of every accepted draw (the launcher's worker ledger), throughput metrics
(learner/step_metrics.py) and the HF checkpoints (learner/checkpoint.py). Held-out evaluation (the built-in task's
probe and ``data.eval_files``) runs on the rollout engines with the pushed weights (learner/evaluation.py), so the
learner spends no step on generation.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from asyncppo.learner import checkpoint as C
from asyncppo.learner import distributed as D
from asyncppo.learner.batch import collate_groups
from asyncppo.learner.build import build_models
from asyncppo.learner.dynamic_sampling import GroupFilter
from asyncppo.learner.lora import LoraExport, adapter_tensors, is_lora
from asyncppo.config.checks import samples_per_group, uses_critic
from asyncppo.learner.push import WeightPusher
from asyncppo.learner.step_metrics import StepMeters
from asyncppo.learner.value_head import uses_shared_head
from asyncppo.models.moe_routing import hooks_of
from asyncppo.stream.validate import ContentLimits, GroupValidator, RejectionSummary

log = logging.getLogger("asyncppo.learner")


class LLMWorkload:
    workers_name = "rollout worker"
    evaluates_on_engines = True
    record_kind = "trajectory"
    pushes_initial_weights = False  # the engines load the model (or the resumed actor) themselves

    def __init__(self, cfg, model_path: str, num_workers: int, output_dir: str, rank: int = 0, world_size: int = 1):
        self.cfg, self.model_path, self.num_workers, self.output_dir = cfg, model_path, num_workers, output_dir
        self.rank, self.world_size, self.multi = rank, world_size, world_size > 1
        self.response_length = cfg.rollout.response_length
        self.resume: Optional[C.Checkpoint] = None  # the checkpoint being resumed from
        self.samples_trained = 0
        self.validator = None
        self.streamed = False

    # --- resume ------------------------------------------------------------------------------------------------
    def _resolve(self) -> Optional[C.Checkpoint]:
        if self.resume is None and self.cfg.trainer.resume_from:
            self.resume = C.resolve_checkpoint(self.cfg.trainer.resume_from)
        return self.resume

    def start_version(self) -> int:
        """The checkpoint's version when resuming (refused past ``trainer.total_steps``), else 0. A checkpoint at
        ``total_steps`` is let through: a learner restarted after it died in the run's final evaluation or save
        (launch/learner_restart.py) trains no step and finishes the run (push, evaluation, ``final/``); a user's
        ``trainer.resume_from`` of a finished run is refused before anything starts (launch/resolve.py)."""
        tr = self.cfg.trainer
        if self._resolve() is None:
            return 0
        if self.resume.version > tr.total_steps:
            raise ValueError(
                f"trainer.resume_from: the checkpoint {self.resume.path!r} is at step {self.resume.version}, past "
                f"trainer.total_steps={tr.total_steps} (the total, not the steps to add)"
            )
        return self.resume.version

    def saved_position(self) -> dict:
        """The prompts each worker had trained when the checkpoint was written (data/position.py)."""
        if self._resolve() is None:
            return {}
        return C.load_trainer_state(self.resume.state_file).get("extra", {}).get("data_position", {})

    def saved_window(self) -> Optional[dict]:
        """The auto window in force when the checkpoint was written (None: a fixed window, or an older checkpoint)."""
        if self._resolve() is None:
            return None
        return C.load_trainer_state(self.resume.state_file).get("extra", {}).get("window")

    def resumed_from(self) -> Optional[str]:
        return self.resume.path if self.resume is not None else None

    # --- models ------------------------------------------------------------------------------------------------
    def build(self, device, wiring) -> None:
        """Load the models (the actor resumes from the checkpoint; the reference and a fresh critic body come from
        the model: learner/build.py); on rank 0 also the pusher and the dynamic-sampling filter."""
        from transformers import AutoTokenizer  # heavy: transformers

        cfg, tr = self.cfg, self.cfg.trainer
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self._resolve() is not None:
            wanted = "head" if uses_shared_head(cfg) else "model"
            C.check_compatible(self.resume, self.model_path, needs_critic=uses_critic(cfg), wanted_critic=wanted)
        models = build_models(cfg, self.model_path, self.resume, device, self.rank, self.world_size)
        self.actor, self.critic, self.updater = models.actor, models.critic, models.updater
        if self.rank > 0:
            if self.resume is not None:
                C.restore(self.resume, self.updater, self.critic)  # collective with rank 0's restore
            return
        self.wiring = wiring
        # Rank 0 saves an unsharded copy when the actor is sharded over several ranks.
        self.plain_actor = models.unsharded_actor()
        if self.resume is not None:
            state = C.restore(self.resume, self.updater, self.critic)
            self.samples_trained = int(state["extra"].get("samples_trained", 0))
        # pushes to every worker's own group (sync/fanout.py) and keeps plain_actor current (learner/push.py)
        lora = is_lora(self.actor)  # LoRA: push the adapters; save the merged model + the adapter (learner/lora.py)
        self.export = LoraExport(self.actor) if lora else self.plain_actor
        self.pusher = WeightPusher(self.actor, self.plain_actor, wiring.fanout, multi=self.multi,
                                   gather_mode=tr.weight_push_gather, budget_bytes=tr.weight_push_budget_mb << 20,
                                   **({"state_of": adapter_tensors} if lora else {}))
        self.streamed = self.pusher.streamed
        al, ro = cfg.algorithm, cfg.rollout
        self.group_filter = GroupFilter(wiring.admission, al.dynamic_sampling,
                                        al.dynamic_sampling_max_skip or 4 * ro.rollout_batch_size)

    def follow(self) -> int:
        return D.run_follower(self.updater, on_checkpoint=self._save_shards)

    def _save_shards(self, version: int) -> None:
        """A follower's shards of a sharded checkpoint. torch.distributed.checkpoint raises a write failure on every
        rank alike; rank 0 reports it and trains on (learner/loop.py ``_checkpoint``), so a follower goes on too."""
        try:
            C.save_sharded(C.sharded_tmp_dir(self.output_dir, version), self.updater, self.critic)
        except C.CheckpointException as exc:
            log.warning("checkpoint step_%d: the sharded save failed on some rank (%s); rank 0 reports it and "
                        "the run trains on", version, str(exc)[:300])

    # --- records in --------------------------------------------------------------------------------------------
    def door(self, current_version):
        """The content validator at the learner's door (recording the draw of every group it accepts) and the
        one-line-per-interval rejection summary (:mod:`asyncppo.stream.validate`): limits from the model's
        vocabulary and the configured lengths."""
        cl, ro, wiring = self.cfg.cluster, self.cfg.rollout, self.wiring
        vocab = int(getattr(getattr(self.plain_actor, "config", None), "vocab_size", 0) or len(self.tokenizer))
        # groups carry the engines' records in the modes that use them (learner: the learner records its own)
        routing = hooks_of(self.actor) if self.cfg.algorithm.routing_replay in ("measure", "rollout") else None
        limits = ContentLimits(vocab_size=vocab, max_prompt_len=ro.prompt_length, max_response_len=ro.response_length,
                               max_samples=samples_per_group(self.cfg), num_workers=self.num_workers,
                               logprob_tolerance=cl.logprob_tolerance,
                               routing=None if routing is None else (routing.shape.layers, routing.shape.top_k,
                                                                     routing.shape.num_experts))
        self.validator = GroupValidator(limits, current_version, ledger=wiring.admission_server)
        summary = RejectionSummary({"stream": lambda: wiring.receiver.rejected,
                                    "content": lambda: self.validator.rejected,
                                    "admission": lambda: wiring.admission_server.rejected}, logger=log)
        return wiring.ledger.door(self.validator), summary

    def on_take(self, group) -> None:
        self.group_filter.on_take(group)  # consumes the ticket, or releases it for a skipped group

    def start_step(self) -> None:
        self.group_filter.start_step()

    def keep(self, groups: list) -> list:
        return self.group_filter.keep(groups)

    def late_error(self, buffer, n: int, got: int, version: int) -> Exception:
        """Name the workers holding the tickets the batch waits for."""
        timeout_s, server = self.cfg.cluster.timeout_s, self.wiring.admission_server
        missing = buffer.missing(n)
        holders = {w: server.held_by(w) for w in range(self.num_workers)}
        late = {w: [t for t in held if t in missing] for w, held in holders.items()}
        late = {w: t for w, t in late.items() if t}
        who = ("; ".join(f"rollout worker {w} holds tickets {t[:8]} and sent nothing for them"
                         for w, t in sorted(late.items())) or "no worker holds them (no tickets granted?)")
        return TimeoutError(
            f"rollout worker(s) {sorted(late) or '?'} late: no trajectories for {timeout_s:.0f}s at policy version "
            f"{version} ({got}/{n} groups; waiting for tickets {missing[:8]}): {who} (cluster.timeout_s)"
        )

    # --- one step ----------------------------------------------------------------------------------------------
    def begin(self, t_train0: float) -> None:
        # throughput, util, buffer (step_metrics.py)
        self.meters = StepMeters(self.num_workers, self.cfg.rollout.max_num_seqs, t_train0)

    def update(self, groups: list, version: int):
        batch = collate_groups(groups, self.tokenizer.pad_token_id)
        routing = hooks_of(self.actor)
        if routing is not None:
            routing.current_version = version  # tokens the engine made at these weights: moe/routing_mismatch_fresh
        metrics = self.updater.step(D.broadcast_batch(batch) if self.multi else batch)
        if self.cfg.algorithm.dynamic_sampling:
            metrics.update(self.group_filter.metrics())
        metrics.update(self.meters.engine_totals.add(groups))
        return metrics, batch

    def push(self, version: int) -> None:
        self.pusher.push(version)

    def step_metrics(self, step: int, version: int, groups: list, batch, t_step: float, t_work: float,
                     buffer_stats: dict) -> dict:
        wiring = self.wiring
        self.meters.record(groups, batch, time.perf_counter() - t_work)
        self.samples_trained += batch.size
        wiring.ledger.record_trained(step, groups)
        return self.meters.step_metrics(
            version=version, t_step=t_step, t_work=t_work, groups=groups, batch=batch,
            samples_trained=self.samples_trained, buffer_stats=buffer_stats,
            stream_rejected=sum(wiring.receiver.rejected.values()),
            content_rejected=self.validator.num_rejected, membership=wiring.ledger.metrics(wiring.fanout),
        )

    # --- checkpoints, the end ---------------------------------------------------------------------------------
    def refresh_weights(self) -> None:
        if self.multi:
            self.pusher.actor_state()  # the collective gather into plain_actor

    def checkpoint(self, version: int, logger, window: Optional[dict] = None) -> None:
        self.refresh_weights()
        t0 = time.perf_counter()

        def sharded(path: str) -> None:  # every rank writes its own shards (collective)
            D.broadcast_checkpoint(version)
            C.save_sharded(path, self.updater, self.critic)

        ckpt = C.save_checkpoint(self.output_dir, version, actor=self.export, tokenizer=self.tokenizer,
                                 updater=self.updater, critic=self.critic, keep=self.cfg.trainer.keep_checkpoints,
                                 sharded=sharded if self.multi else None,
                                 extra={"samples_trained": self.samples_trained,
                                        "data_position": self.wiring.ledger.trained.state_dict(),
                                        **({"window": window} if window else {})})
        logger.message(f"checkpoint {ckpt.path} written in {time.perf_counter() - t0:.2f}s")

    def save_final(self, final_dir: str, version: int) -> None:
        self.export.save_pretrained(final_dir)
        self.tokenizer.save_pretrained(final_dir)

    def run_info(self) -> dict:
        return {}

    def summary(self, buffer_stats: dict) -> dict:
        return dict(samples_trained=self.samples_trained, buffer=buffer_stats, rejected=self.rejections(),
                    rollout=self.meters.engine_totals.summary(), admission=self.wiring.admission_server.summary())

    def rejections(self) -> dict:
        """Every refusal so far, by source and reason (summary.json, metrics)."""
        wiring = self.wiring
        out = {f"stream/{k}": v for k, v in wiring.receiver.rejected.items()}
        if self.validator is not None:
            out.update({f"content/{k}": v for k, v in self.validator.rejected.items()})
        out.update({f"admission/{k}": v for k, v in wiring.admission_server.rejected.items()})
        return out
