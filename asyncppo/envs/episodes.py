"""Multi-turn episodes in continuous generation: a small state machine per episode around a streaming engine.

Why a wrapper and not a new engine: the engine only ever sees single-turn requests of ``n=1`` (prompt ids in,
token ids + behaviour log-probs + per-token versions out), so vLLM and the transformers backend run episodes
alike and none of their weight-update machinery changes. An episode moves through

    init (environment) -> generate (engine) -> step (environment) -> generate -> ... -> done

A sequence whose turn ended *leaves the engine* while its environment works: the call runs on
:class:`asyncppo.envs.env_runner.EnvRunner`'s threads (bounded by ``env.max_concurrency``, a deadline of
``env.step_timeout_s``; a coroutine environment on one event loop), and its outcome comes back through a queue that
:meth:`EpisodeEngine.step` reads, so other groups' sequences fill its slots and nothing waits on a thread of its
own. The next turn re-enters the engine as a new request whose prompt is the *whole prefix as token ids*: prompt +
the model's ids as sampled + the environment's ids as rendered by :func:`asyncppo.envs.chat.turn_ids` (appended,
never re-tokenized). With vLLM's prefix caching (``enable_prefix_caching``) the prefix's keys/values are reused
where the cache still holds them; a request is salted with the weight version, so a prefix cached under older
weights is recomputed, never reused.

A group of ``n`` episodes is ``n`` requests of ``n=1`` (each episode has its own environment and its own turn
boundaries) and goes out once all ``n`` ended, as one :class:`EpisodeGroup` whose completions carry ``env_runs``
and ``turn_rewards`` (the trajectory form of docs/environments.md).

Limits: ``max_turns`` model turns; a total budget of ``response_length`` tokens after the prompt, model and
environment tokens alike (each turn's ``max_tokens`` is what remains, capped by ``turn_max_tokens`` when set); an
episode that runs out of budget ends there, counted in ``counters["truncated"]``.

Branches (agent programs, docs/agents.md): a step whose info says ``branch`` carries a rewritten conversation (the
messages after the episode's first ones). The episode's response restarts after its prompt: the model turns so far
are dropped (``counters["branch_tokens_dropped"]``; with ``branch == "all"`` kept as a sample of their own, which
the group then carries beside the episode's last branch), the rewritten conversation becomes one environment segment
(:func:`asyncppo.envs.chat.branch_text`), and the next model turn follows it. ``max_turns`` counts every turn of
every branch.

Versions: every model token keeps the version the engine stamped on it (an update may land inside a turn or between
two); an environment token takes the version of the model token before it (the convention of docs/environments.md).

MoE routing records (``algorithm.routing_replay``): each turn's request records every position of its prefix; the
episode keeps, for each position, the record of the turn that first computed it (:func:`~asyncppo.envs.episode_state.stitch_routing`).
"""

from __future__ import annotations

import queue
import time
from typing import Any, Optional, Sequence

from asyncppo.envs.chat import IM_END, branch_text, turn_ids
from asyncppo.envs.env_runner import EnvOutcome, EnvRunner
from asyncppo.envs.episode_state import EpisodeCompletion, EpisodeGroup, EpisodeState, completions_of, stitch_routing

__all__ = ["COUNTERS", "EpisodeCompletion", "EpisodeEngine", "EpisodeGroup", "TURN_SEED_STRIDE"]
from asyncppo.rollout.engine import Completion, SamplingSpec

#: Turn ``k`` of episode ``j`` samples with seed ``spec.seed + j + k * TURN_SEED_STRIDE``: turn 0 follows the
#: single-turn convention (sample ``j`` of a group: ``seed + j``), later turns stay clear of other groups' seeds.
TURN_SEED_STRIDE = 1_000_033

#: Episode counters (``EpisodeEngine.counters``).
COUNTERS = ("episodes", "turns", "truncated", "max_turns", "dropped_groups", "env_tokens", "model_tokens", "branches",
            "branch_tokens_dropped")


class EpisodeEngine:
    """Runs groups of multi-turn episodes through a :class:`~asyncppo.rollout.engine.StreamingEngine`.

    ``tokenizer`` renders environment turns (its chat template) and decodes the model's turns for the environment;
    ``runner`` makes the environment calls. Drive it like a streaming engine: :meth:`add_group`, then :meth:`step`
    until the groups come back. Weight updates go to the wrapped engine (``engine``) as before."""

    def __init__(self, engine: Any, tokenizer: Any, runner: EnvRunner, *, max_turns: int, response_length: int,
                 turn_max_tokens: Optional[int] = None, stop_text: str = IM_END,
                 max_prompt_tokens: Optional[int] = None):
        if max_turns < 1 or response_length < 1:
            raise ValueError(f"episodes: max_turns={max_turns} and response_length={response_length} must be >= 1")
        self.engine, self.tokenizer, self.runner = engine, tokenizer, runner
        self.max_turns, self.response_length, self.turn_max_tokens = max_turns, response_length, turn_max_tokens
        self.max_prompt_tokens = max_prompt_tokens  # rollout.prompt_length: a longer rendered prompt drops its group
        self.stop_text = stop_text
        stop_id = tokenizer.convert_tokens_to_ids(stop_text)
        self._stop_id = stop_id if isinstance(stop_id, int) and stop_id != tokenizer.unk_token_id else None
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._groups: dict[str, list[EpisodeState]] = {}
        self._dropped: dict[str, str] = {}
        self._requests: dict[str, EpisodeState] = {}  # engine request key -> episode generating
        self._at_env = 0  # episodes whose environment is working
        self.env_wait_s = 0.0  # seconds step() waited with the engine empty and episodes at their environments
        self.last_stepped = 0  # sequences in the wrapped engine at the last step (0: the step only waited)
        self.last_wait_s = 0.0  # seconds the last step waited for an environment with the engine empty
        self._results: queue.SimpleQueue = queue.SimpleQueue()

    idle_wait_s = 0.05  # how long step() waits for an environment when the engine has nothing to decode

    @property
    def max_num_seqs(self) -> int:
        return self.engine.max_num_seqs

    # ------------------------------------------------------------------------------------------------ interface
    def add_group(self, key: str, prompt_ids: Optional[Sequence[int]], spec: SamplingSpec, envs: Sequence[Any],
                  prompt_messages: Optional[list] = None) -> None:
        """Start ``spec.n`` episodes, one per environment in ``envs``. ``prompt_ids`` None: the prompt is the
        chat rendering of what the environment's ``init`` returns (with its ``tools``). Never blocks."""
        if len(envs) != spec.n:
            raise ValueError(f"episodes: group {key!r} has n={spec.n} samples but {len(envs)} environments")
        if key in self._groups:
            raise ValueError(f"episodes: group key {key!r} is already in flight")
        ids = None if prompt_ids is None else [int(t) for t in prompt_ids]
        self._groups[key] = [EpisodeState(key, j, env, ids, spec) for j, env in enumerate(envs)]
        for ep in self._groups[key]:
            self._to_env(ep, "init", list(prompt_messages or []))

    def step(self) -> list:
        """Take the environments' answers (re-entering the engine), run one engine step, hand its finished turns
        to their environments; return the groups whose episodes all ended. With the engine empty and episodes at
        their environments, waits up to ``idle_wait_s`` for an answer instead of returning at once (no spinning).

        A group some other caller added to the wrapped engine directly (the rollout worker's single-turn evaluation
        groups) is returned as the engine finished it, untouched."""
        idle = not self.engine.num_unfinished_seqs() and self._at_env
        t0 = time.perf_counter()
        self._take_env_results(self.idle_wait_s if idle else 0.0)
        self.last_wait_s = time.perf_counter() - t0 if idle else 0.0
        self.env_wait_s += self.last_wait_s
        self.last_stepped = self.engine.num_unfinished_seqs()  # what this step runs (the worker's meter reads it)
        finished = self.engine.step() if self.last_stepped else []
        foreign = []
        for done in finished:
            if done.key not in self._requests:
                foreign.append(done)
                continue
            ep = self._requests.pop(done.key)
            if ep.ended is None:  # ended: its group was dropped meanwhile
                self._on_turn(ep, done.completions[0])
        return foreign + self._collect()

    def num_unfinished_seqs(self) -> int:
        """Episodes started and not ended (in the engine or waiting for their environment), plus the sequences of
        groups added to the wrapped engine directly, plus the turns of ended episodes still in the engine (a
        dropped group's: they must be stepped out, or they would hold their slots while the worker, seeing nothing
        to step, never steps again)."""
        foreign = max(0, self.engine.num_unfinished_seqs() - len(self._requests))
        orphans = sum(ep.ended is not None for ep in self._requests.values())
        return foreign + orphans + sum(ep.ended is None for eps in self._groups.values() for ep in eps)

    def num_running_seqs(self) -> int:
        """Sequences in the engine (what fills its slots; an episode at its environment holds none)."""
        return self.engine.num_unfinished_seqs()

    def num_at_env(self) -> int:
        return self._at_env

    def set_weight_version(self, version: int) -> None:
        self.engine.set_weight_version(version)

    def recompute_inflight(self) -> None:
        self.engine.recompute_inflight()

    def abort_all(self) -> list[str]:
        """Drop every group in flight (shutdown); the environments of unfinished episodes are closed."""
        self.engine.abort_all()
        for eps in self._groups.values():
            for ep in eps:
                if ep.ended is None:
                    self.runner.start(ep.env, "close")
        keys = sorted(self._groups)
        self._groups.clear()
        self._requests.clear()
        return keys

    def close(self) -> None:
        """Nothing of its own to stop: the environment calls run on the runner, which its owner shuts down."""

    # ------------------------------------------------------------------------------------------------ transitions
    def _to_env(self, ep: EpisodeState, what: str, arg: Any) -> None:
        self._at_env += 1
        fut = self.runner.start(ep.env, what, arg)  # settled by its deadline at the latest, on the runner's threads
        fut.add_done_callback(lambda f, ep=ep, what=what: self._results.put((ep, what, f)))

    def _take_env_results(self, wait_s: float) -> None:
        while True:
            try:
                ep, what, fut = self._results.get(timeout=wait_s) if wait_s > 0 else self._results.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            self._at_env -= 1
            try:
                outcome: EnvOutcome = fut.result()
            except Exception as e:  # the runner turns faults into outcomes; this is a bug in the glue, named
                outcome = EnvOutcome(done=True, fault="raised", detail=f"{type(e).__name__}: {e}",
                                     drop=self.runner.on_error == "drop")
            if ep.ended is None and ep.group in self._groups:
                self._after_env(ep, what, outcome)

    def _after_env(self, ep: EpisodeState, what: str, out: EnvOutcome) -> None:
        if out.fault is not None:
            if what == "step":
                ep.turn_rewards[-1] = 0.0
            if out.drop or what == "init":
                return self._drop_group(ep.group, out.fault, out.detail)
            return self._end(ep, out.fault)
        if what == "init":
            ep.first_messages = list(out.observations)
            if ep.prompt_ids is None and out.info.get("prompt_ids") is not None:  # an agent's text call (no template)
                ep.prompt_ids = [int(t) for t in out.info["prompt_ids"]]
            if ep.prompt_ids is None:
                text = self.tokenizer.apply_chat_template(out.observations, tools=getattr(ep.env, "tools", None)
                                                          or None, tokenize=False, add_generation_prompt=True)
                ep.prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
            if self.max_prompt_tokens is not None and len(ep.prompt_ids) > self.max_prompt_tokens:
                # the learner would refuse the record: drop the group here, named, and its ticket is given back
                self.runner.faults["malformed"] += 1
                return self._drop_group(ep.group, "malformed", f"the rendered prompt is {len(ep.prompt_ids)} tokens, "
                                        f"over rollout.prompt_length={self.max_prompt_tokens}")
            return self._generate(ep)
        ep.turn_rewards[-1] = float(out.reward)
        if out.done:
            return self._end(ep, "done")
        if ep.turn_number >= self.max_turns:
            return self._end(ep, "max_turns")
        if out.info.get("branch"):
            return self._branch(ep, out.observations, keep=out.info["branch"] == "all")
        if out.info.get("env_ids") is not None:  # an agent's text call: the ids its prompt added, as they are
            env_ids = [int(t) for t in out.info["env_ids"]]
        else:
            env_ids = turn_ids(self.tokenizer, out.observations, tools=getattr(ep.env, "tools", None),
                               model_stop_text=ep.model_stop_text)
        if len(ep.ids) + len(env_ids) >= self.response_length:  # no room left for one more model token
            return self._end(ep, "truncated")
        if env_ids:
            ep.append_env(env_ids)
            self.counters["env_tokens"] += len(env_ids)
        self._generate(ep)

    def _branch(self, ep: EpisodeState, rest: list, keep: bool) -> None:
        """The agent rewrote its history (module docstring, "Branches"): restart the response after the prompt with
        the rewritten conversation as one environment segment; the earlier branch's tokens are dropped, or kept as a
        sample of their own (``keep``)."""
        try:
            env_ids = self.tokenizer.encode(branch_text(self.tokenizer, ep.first_messages, rest,
                                                        tools=getattr(ep.env, "tools", None)),
                                            add_special_tokens=False)
        except ValueError as e:  # the session checks the messages first: this is a template that renders otherwise
            self.runner.faults["malformed"] += 1
            if self.runner.on_error == "drop":
                return self._drop_group(ep.group, "malformed", f"branch: {e}")
            ep.turn_rewards[-1] = 0.0
            return self._end(ep, "malformed")
        if len(env_ids) >= self.response_length:  # no room for one model token after it: the branch it had stands
            return self._end(ep, "truncated")
        self.counters["branches"] += 1
        set_aside = ep.restart(keep)
        if not keep:
            self.counters["branch_tokens_dropped"] += set_aside
        # the opening's tokens carry the engine's version now: no later than the next model token's, and as fresh
        ep.branch_version = max(ep.branch_version, int(getattr(self.engine, "version", 0)))
        if env_ids:
            ep.append_env(env_ids)
            self.counters["env_tokens"] += len(env_ids)
        self._generate(ep)

    def _generate(self, ep: EpisodeState) -> None:
        """Re-enter the engine with the whole prefix as ids; this turn may use what the budget leaves."""
        left = self.response_length - len(ep.ids)
        # an environment may limit the turn about to start (an agent's call: its max_tokens and stop ids)
        next_turn = getattr(ep.env, "next_turn", None)
        asked, extra_stops = next_turn() if callable(next_turn) else (None, ())
        stops = tuple(ep.spec.stop_token_ids) + ((self._stop_id,) if self._stop_id is not None else ()) \
            + tuple(extra_stops)
        spec = SamplingSpec(n=1, max_tokens=min(left, self.turn_max_tokens or left, asked or left),
                            temperature=ep.spec.temperature, top_p=ep.spec.top_p, top_k=ep.spec.top_k,
                            seed=None if ep.spec.seed is None else ep.spec.seed + ep.index
                            + TURN_SEED_STRIDE * ep.turn_number, stop_token_ids=stops)
        key = ep.request_key
        self._requests[key] = ep
        self.engine.add_group(key, ep.prompt_ids + ep.ids, spec)

    def _on_turn(self, ep: EpisodeState, c: Completion) -> None:
        stitch_routing(ep, c.routed_experts)
        ids = [int(t) for t in c.token_ids]
        if c.versions is not None:
            versions = [int(v) for v in c.versions]
        else:
            versions = [int(getattr(self.engine, "version", 0))] * len(ids)
        ep.ids += ids
        ep.logprobs += [float(x) for x in c.logprobs]
        ep.versions += versions
        ep.turn_rewards.append(0.0)
        ep.last_finish = c.finish_reason
        self.counters["turns"] += 1
        self.counters["model_tokens"] += len(ids)
        stopped = c.finish_reason == "stop" and ids
        ep.model_stop_text = self.stop_text if stopped and ids[-1] == self._stop_id else ""
        action = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        hook = getattr(ep.env, "on_model_turn", None)  # an agent's call waits for this turn (agents/episode.py)
        if callable(hook):
            try:
                hook(token_ids=ids, logprobs=ep.logprobs[-len(ids):] if ids else [], versions=versions,
                     finish_reason=c.finish_reason, text=action, prompt_tokens=len(ep.prompt_ids) + len(ep.ids)
                     - len(ids))
            except Exception as e:  # the adapter's bug must not end the worker: this episode's fault, named
                self.runner.faults["raised"] += 1
                if self.runner.on_error == "drop":
                    return self._drop_group(ep.group, "raised", f"on_model_turn raised {type(e).__name__}: {e}")
                return self._end(ep, "raised")
        if len(ep.ids) >= self.response_length:
            return self._end(ep, "truncated")  # the budget is spent: no environment reply would fit
        self._to_env(ep, "step", action)

    def _end(self, ep: EpisodeState, why: str) -> None:
        ep.ended = why
        self.counters["episodes"] += 1
        if why in ("truncated", "max_turns"):
            self.counters[why] += 1
        self.runner.start(ep.env, "close")

    def _drop_group(self, key: str, why: str, detail: str) -> None:
        """End every episode of the group now (their environments close; a turn still in the engine runs out and
        is discarded: the engine interface has no per-request abort)."""
        self._dropped.setdefault(key, detail)
        for ep in self._groups[key]:
            if ep.ended is None:
                self._end(ep, why)

    def _collect(self) -> list[EpisodeGroup]:
        out = []
        for key in [k for k, eps in self._groups.items() if all(ep.ended is not None for ep in eps)]:
            eps = self._groups.pop(key)
            if key in self._dropped:
                self.counters["dropped_groups"] += 1
                out.append(EpisodeGroup(key, [], dropped=True, detail=self._dropped.pop(key)))
                continue
            if any(ep.prompt_ids != eps[0].prompt_ids for ep in eps):
                self.counters["dropped_groups"] += 1
                out.append(EpisodeGroup(key, [], dropped=True, detail="its environments rendered different prompts "
                                        "(one record has one prompt: the n environments of a group must agree)"))
                continue
            out.append(EpisodeGroup(key, [c for ep in eps for c in completions_of(ep)], prompt_ids=list(eps[0].prompt_ids)))
        return out
