"""The rollout worker for text environments: the LLM worker's loop, with multi-turn episodes instead of single turns.

Why a subclass here and not a branch in :mod:`asyncppo.rollout.worker`: the episode loop lives in envs/, which
imports the rollout engine's types, so rollout/ cannot import envs/ without a cycle; launch/ picks this class when
``env.text_env`` is set. What differs from the single-turn worker, and nothing else:

* the engine is wrapped in :class:`~asyncppo.envs.episodes.EpisodeEngine` (vLLM with prefix caching and 32-token
  blocks, so a turn that re-enters with its whole prefix reuses the cached part); weights still load into the
  wrapped engine (``model_engine``); evaluation groups of the task's probe and of ``{prompt, answer}`` files go
  to it directly and stay single-turn, while SkyRL-format ``data.eval_files`` are played as episodes
  (:meth:`EpisodeRolloutWorker._start_episodes`, the evaluator's ``start_episodes``), scored by their environment;
* admission room counts the sequences *in the engine* (``num_running_seqs``: an episode waiting for its
  environment holds no slot), while step-or-idle asks ``num_unfinished_seqs`` (that episode still needs steps);
* rows: ``data.train_files`` in SkyRL's format (``prompt`` a list of chat messages) are drawn as
  :class:`~asyncppo.data.text_row_draws.TextRowDataset` (the same shards, order and draw numbers as prompt rows);
  a group of such a row gets ``n`` environments ``make_text_env(cls, row extras, env.text_env_config,
  max_turns=env.max_turns)`` whose ``init`` gets the row's messages; a text prompt row (the task's, or a
  ``{prompt, answer}`` file) gets ``cls({}, extras={prompt, answer, index})`` and its text as one user message;
  either way the group's record carries the prompt the episodes rendered;
* a group dropped by an environment fault (``env.on_error=drop``) gives its ticket back, so the slot is granted again;
* the meter adds episode counters to the group's timings (turns, truncations, tool calls, environment seconds),
  which the learner turns into step metrics (:func:`asyncppo.metrics.rollout.episode_metrics`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from asyncppo.data.datasets import PromptItem
from asyncppo.data.text_row_draws import TextRowDataset, draws_text_env_rows
from asyncppo.data.text_rows import TextEnvRow
from asyncppo.envs.env_runner import FAULT_KINDS, EnvRunner
from asyncppo.envs.episode_groups import EpisodeGroupBuilder
from asyncppo.envs.episodes import EpisodeEngine
from asyncppo.envs.text_env import load_text_env, make_text_env
from asyncppo.envs.tools import ToolCallCounter, declared_tool_names, parse_tool_calls
from asyncppo.rollout.engine import SamplingSpec
from asyncppo.rollout.meter import EngineMeter
from asyncppo.rollout.worker import RolloutWorker
from asyncppo.staleness.episode_load import EngineShare, engine_load

log = logging.getLogger("asyncppo.rollout")

#: vLLM caches whole blocks only; its CPU default (128 tokens) is longer than a short turn's prefix.
PREFIX_BLOCK_SIZE = 32


def tool_names(env) -> list:
    """The names of the tools an environment declares (JSON schemas, OpenAI's nested form or flat)."""
    return declared_tool_names(getattr(env, "tools", None))


class CountingRunner(EnvRunner):
    """An :class:`EnvRunner` that also counts the tool calls in each action it hands an environment (read with the
    template's own syntax; a malformed call or a call of an undeclared tool counts as a tool error)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = ToolCallCounter()

    def start(self, env, what: str, arg=None):
        if what == "step" and isinstance(arg, str) and "<tool_call>" in arg:
            try:
                self.tools.add(parse_tool_calls(arg, tool_names(env) or None))
            except Exception:  # an environment's odd ``tools``: the count is a metric, the call goes on
                log.debug("tool-call count skipped for %s", type(env).__name__, exc_info=True)
        return super().start(env, what, arg)


#: Time integrals the meter keeps (episode-seconds at each stage over ``spread_s`` wall seconds).
SPREAD = ("spread_s", "at_env_sum", "in_engine_sum", "groups_sum", "tickets_waiting_sum")


class EpisodeMeter(EngineMeter):
    """The engine meter plus what the episodes did since the last group was sent (deltas of run counters)."""

    def __init__(self, episodes: EpisodeEngine, runner: CountingRunner):
        super().__init__()
        self.episodes, self.runner = episodes, runner
        self._last = self._totals()
        # time integrals of where the worker's episodes are (Little's law: which stage holds them, for how long)
        self._spread = dict.fromkeys(SPREAD, 0.0)
        self._sampled_at: float | None = None
        self._counts = dict.fromkeys(SPREAD[1:], 0)

    def sample(self, **counts: int) -> None:
        """Called once per worker turn with the counts now (episodes at their environment, in the engine, groups in
        flight, tickets granted and not started): the previous counts held since the previous call."""
        now = time.perf_counter()
        if self._sampled_at is not None:
            dt = now - self._sampled_at
            self._spread["spread_s"] += dt
            for key, n in self._counts.items():
                self._spread[key] += n * dt
        self._sampled_at, self._counts = now, {f"{k}_sum": v for k, v in counts.items()}

    def _totals(self) -> dict[str, float]:
        c, tools = self.episodes.counters, self.runner.tools.counts
        return {"episode_turns": c["turns"], "episodes_ended": c["episodes"], "episodes_truncated": c["truncated"],
                "episodes_dropped": c["dropped_groups"], "episode_branches": c["branches"],
                "branch_tokens_dropped": c["branch_tokens_dropped"], "tool_calls": tools["calls"],
                "tool_errors": tools["malformed"] + tools["unknown"], "env_calls": self.runner.step_calls,
                "env_s": self.runner.step_seconds, "env_faults": sum(self.runner.faults.values()),
                "env_wait_s": self.episodes.env_wait_s,
                **{f"env_faults_{kind}": self.runner.faults[kind] for kind in FAULT_KINDS}}

    def take(self) -> dict[str, float]:
        now = self._totals()
        delta = {k: float(now[k] - self._last[k]) for k in now}
        self._last = now
        engine = super().take()
        # time the engine sat empty waiting for environments was spent inside step(): it is waiting, not decoding
        engine["engine_busy_s"] = max(0.0, engine["engine_busy_s"] - delta["env_wait_s"])
        spread, self._spread = self._spread, dict.fromkeys(SPREAD, 0.0)
        return {**engine, **delta, **spread}


class EpisodeRolloutWorker(RolloutWorker):
    """:class:`RolloutWorker` running ``env.text_env`` episodes (module docstring)."""

    def _engine_opts(self) -> dict:
        return {"enable_prefix_caching": True, "block_size": PREFIX_BLOCK_SIZE} if self.cfg.rollout.engine == "vllm" \
            else {}

    def _open_workload(self) -> None:
        super()._open_workload()
        e, ro = self.cfg.env, self.cfg.rollout
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"env.text_env={e.text_env!r}: the tokenizer of model.path={self.cfg.model.path!r} has "
                             "no chat template, which renders the environment's turns")
        self.env_class = load_text_env(e.text_env)
        self.runner = CountingRunner(e.max_concurrency, e.step_timeout_s, e.on_error)
        self.engine = EpisodeEngine(self.model_engine, self.tokenizer, self.runner, max_turns=e.max_turns,
                                    response_length=ro.response_length, turn_max_tokens=e.max_tokens_per_turn,
                                    max_prompt_tokens=ro.prompt_length)
        self._closables += [self.engine, _Shutdown(self.runner)]
        self.builder = EpisodeGroupBuilder(self.model_engine, self.worker_id, self.stats)
        self.meter = EpisodeMeter(self.engine, self.runner)
        self.engine_share = EngineShare()
        self.stats.update(dropped_groups=0, groups_started=0, groups_abandoned=0)
        if self.evaluator is not None:  # SkyRL-format eval files are played as episodes (rollout/evaluation.py)
            self.evaluator.start_episodes = self._start_episodes

    def _announce(self, num_prompts: int) -> None:
        super()._announce(num_prompts)
        e = self.cfg.env
        print(f"[asyncppo] rollout worker {self.worker_id}: episodes of {e.text_env}, max_turns={e.max_turns}, "
              f"max_tokens_per_turn={e.max_tokens_per_turn}, on_error={e.on_error}, "
              f"prefix caching={'on' if self._engine_opts() else 'n/a'}", flush=True)

    def _occupied(self) -> int:
        """The engine load the episodes in flight will make, not the load this instant (:class:`EngineShare`): the
        sequences in the engine now, or the episodes in flight times the share of its life an episode spends in
        the engine, whichever is larger."""
        return engine_load(self.engine.num_running_seqs(), self.engine.num_unfinished_seqs(), self.engine_share.share)

    def _stepped(self, before: int) -> tuple[int, float]:
        return self.engine.last_stepped, self.engine.last_wait_s

    def _holds_sequences(self) -> bool:
        return self.engine.num_running_seqs() > 0

    def _work(self) -> None:
        at_env, running = self.engine.num_at_env(), self.engine.num_running_seqs()
        self.engine_share.add(running, at_env)
        self.meter.sample(at_env=at_env, in_engine=running, groups=len(self._in_flight),
                          tickets_waiting=len(self._pending))
        super()._work()

    def _env_health(self) -> dict | None:
        """The environment calls' health for the launcher's ping (rollout/skeleton.py): an engine step that only
        waited for environments counts as progress, so a pool whose calls all hang shows only here."""
        runner = getattr(self, "runner", None)  # made when the workload opens
        return runner.health() if runner is not None else None

    def _train_dataset(self, tokenizer):
        if draws_text_env_rows(self.cfg):
            return TextRowDataset.from_files(list(self.cfg.data.train_files), prompt_key=self.cfg.data.prompt_key)
        return super()._train_dataset(tokenizer)

    def _start_group(self, key: str, row, spec: SamplingSpec) -> None:
        self.stats["groups_started"] += 1
        self._start_episodes(key, row, spec)

    def _start_episodes(self, key: str, row, spec: SamplingSpec) -> None:
        """``spec.n`` episodes of ``row``: a training group, or an evaluation group of a SkyRL-format eval file
        (the evaluator calls this as its ``start_episodes``)."""
        e = self.cfg.env
        if isinstance(row, TextEnvRow):
            extras, messages = row.episode_extras(), [dict(m) for m in row.prompt_messages]
        else:
            # the environment's init renders the prompt (with its tools); the row's text is its first user message
            extras = {"prompt": row.prompt, "answer": row.answer, "index": row.index}
            messages = [{"role": "user", "content": row.prompt}]
        envs = [make_text_env(self.env_class, extras, e.text_env_config, max_turns=e.max_turns)
                for _ in range(spec.n)]
        self.engine.add_group(key, None, spec, envs, prompt_messages=messages)

    def _before_close(self) -> None:
        """One closing line of where every granted ticket went (granted = started + not yet started; started =
        sent + dropped + in flight at the stop + abandoned by a learner restart) and of the worker's environment
        faults by kind: totals, where the step metrics carry only what was sent along with a group. (The abort comes first: a worker that failed
        before its runner existed still aborts what its engine holds.)"""
        in_flight = len(self._in_flight)
        super()._before_close()
        if getattr(self, "runner", None) is None:
            return
        s, faults, tools = self.stats, dict(self.runner.faults), self.runner.tools.counts
        print(f"[asyncppo] rollout worker {self.worker_id}: episode groups started {s['groups_started']}, sent "
              f"{s['groups_sent']}, dropped {s['dropped_groups']}, in flight at stop {in_flight}, abandoned by a "
              f"learner restart {s['groups_abandoned']}, tickets not started {len(self._pending)}; env faults {faults}; tool calls {tools['calls']}, "
              f"tool errors {tools['malformed'] + tools['unknown']}", flush=True)

    def _drop_work(self, position) -> None:
        self.stats["groups_abandoned"] += len(self._in_flight)  # a restarted learner regenerates them
        super()._drop_work(position)

    def _finish_group(self, done) -> None:
        flight = self._in_flight.pop(done.key)
        if done.dropped:
            self.admission.release(flight.ticket)
            self.stats["dropped_groups"] += 1
            log.warning("worker %d: group %s dropped (%s); its ticket is given back", self.worker_id, done.key,
                        done.detail)
            return
        flight = dataclasses.replace(flight, row=_record_row(flight.row, done.prompt_ids))
        self._send(self.builder.build(done, flight, self.meter))


def _record_row(row, prompt_ids) -> PromptItem:
    """The row as the group's record names it: the prompt the episodes rendered, and for a SkyRL row its reward
    spec's ground truth as the record's answer (informative: the environment scored the episodes)."""
    if not isinstance(row, TextEnvRow):
        return dataclasses.replace(row, prompt_ids=list(prompt_ids))
    truth = (row.extras.get("reward_spec") or {}).get("ground_truth", "")
    return PromptItem(index=row.index, prompt=row.prompt_messages[-1]["content"], prompt_ids=list(prompt_ids),
                      answer="" if truth is None else str(truth))


class _Shutdown:
    """Closes the runner's pool with the worker (the worker's closables call ``close()``)."""

    def __init__(self, runner: EnvRunner):
        self.runner = runner

    def close(self) -> None:
        self.runner.shutdown()
