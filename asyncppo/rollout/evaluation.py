"""The run's one held-out evaluation, on the rollout engines, interleaved with training generation.

What it measures
----------------
Every held-out set of the run (data/heldout.py): the built-in task's probe (logged as ``eval/accuracy_sampled``,
``eval/accuracy_greedy``: ``HeldOutProbe``'s rows, samples, seed, token budget and exact-answer scoring) and each
of ``data.eval_files`` (``eval/<file>/...``, scored with the run's reward function; in a text-environment run,
SkyRL-format files are played as episodes with ``env.text_env`` and scored by the environment, greedy and sampled
alike). The learner runs no generation of its own: on the built-in recipe it is the bottleneck, and the engines
have room.

When it runs
------------
The evaluation points are version 0 (unless ``trainer.eval_at_start=false``), every ``trainer.eval_every`` versions,
and ``trainer.total_steps`` (the learner pushes the final weights when there is something to evaluate). A worker evaluates a point with the first weights it
holds at or after it: weights arrive only every ``rollout.sync_every`` versions, and a worker may skip a version
when pushes come faster than it loads. The report names both the point and the versions actually used. A resumed run
skips the points it has passed.

How it shares the engine
------------------------
Each prompt of the worker's shard becomes two engine groups, one greedy answer and the set's samples (the probe's 4,
``data.eval_samples`` for a file) at the rollout temperature. They go into the same engine as training groups, up to
half of ``rollout.max_num_seqs`` at a time; the other half keeps generating training data, so an evaluation never
stops the stream the learner waits on, and on a long-tailed workload the evaluation fills slots that the tail would
leave empty anyway. Eval groups carry no
ticket and are never streamed as trajectories. A file's rewards come from the run's reward function, so its
"accuracy" is the mean reward (the fraction correct for 0/1 rewards); the task probe's is the fraction of exact
answers that end within its budget.

Seeds: the sampled answers of prompt ``i`` are seeded per request (vLLM's ``SamplingParams.seed``; the transformers
engine gives each seeded sample its own ``torch.Generator``), so they do not depend on what else shares the engine.
The probe uses ``trainer.seed`` and the same seeds at every point; eval files use ``rollout.sampling.seed`` (unseeded
when it is None) varied per point.

One round, one version: while a round is in the engine the worker leaves newly announced weights unloaded (it
keeps generating training data with the ones it holds; the lag guard bounds how far the learner gets ahead) and
loads them when the round is done, so a held-out number never mixes two policies. On a long-tailed task the
engine, not the learner, is the bottleneck, and a round there can take several learner steps: without this the
probe's "before" at step 0 was measured partly with the weights of steps 1-8 (measured, ``data=reverse`` on vLLM).
``version_max`` still reports the newest version of any answer.
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Optional

from asyncppo.data.heldout import EvalSet, eval_file_sets, is_exact_answer, task_eval_set
from asyncppo.data.rewards import score_safely
from asyncppo.rollout.engine import FinishedGroup, SamplingSpec
from asyncppo.stream.evals import TASK_SET, EvalReport, FileScores

log = logging.getLogger("asyncppo.rollout")

KEY_PREFIX = "eval:"


def eval_points(eval_every: int, total_steps: int, at_start: bool = True) -> list[int]:
    """Version 0 (unless ``at_start`` is false), every ``eval_every`` versions, and the last version."""
    points = set(range(0, total_steps + 1, eval_every)) if eval_every > 0 else {0}
    if not at_start:
        points.discard(0)
    points.add(total_steps)
    return sorted(points)


@dataclass
class _Round:
    point: int
    version: int
    queue: collections.deque  # (key, set name, row, spec) still to add to the engine
    outstanding: int  # groups added and not finished
    scores: dict
    version_max: int


class EvalRunner:
    """The worker's evaluation state: which point is due, what to add next, and the sums so far."""

    def __init__(self, cfg, datasets: dict, worker_id: int, decode, reward_fn, score, resumed: bool):
        """``datasets``: name -> :class:`EvalSet` (this worker's shard); a bare dataset is an eval file's shard,
        sampled with ``data.eval_samples`` up to ``rollout.response_length`` tokens."""
        ro = cfg.rollout
        self.worker_id = worker_id
        self.sets = {name: s if isinstance(s, EvalSet) else
                     EvalSet(s, samples=cfg.data.eval_samples, max_tokens=ro.response_length, seed=ro.sampling.seed)
                     for name, s in datasets.items()}
        self._decode, self._reward_fn, self._score = decode, reward_fn, score
        self.budget = max(1, ro.max_num_seqs // 2)  # sequences evaluation may hold in the engine at once
        self.temperature, self.top_p, self.top_k = ro.sampling.temperature, ro.sampling.top_p, ro.sampling.top_k
        self._eval_every, self._total_steps = cfg.trainer.eval_every, cfg.trainer.total_steps
        self._at_start = cfg.trainer.eval_at_start
        self._points = collections.deque(eval_points(self._eval_every, self._total_steps, self._at_start))
        self._skip_until_loaded = resumed  # version 0 is a placeholder stamp until the checkpoint's push lands
        self._round: Optional[_Round] = None
        self._inflight_seqs = 0
        self._answers: dict[str, tuple] = {}  # engine key -> (reference answer, n), for groups in the engine
        # starts one group of episodes (key, SkyRL-format row, spec) for a set of ``episodes``: the text-environment
        # worker sets it (envs/episode_worker.py; rollout/ cannot import envs/)
        self.start_episodes: Optional[Callable] = None

    def restart(self) -> None:
        """A restarted learner: the round in the engine was aborted; the points from the checkpoint on are due
        again once its weights have loaded (points before it are the dead learner's history)."""
        self._round, self._inflight_seqs, self._answers = None, 0, {}
        self._points = collections.deque(eval_points(self._eval_every, self._total_steps, self._at_start))
        self._skip_until_loaded = True

    # ------------------------------------------------------------------------------------------------------------
    def on_version(self, version: int, loaded: bool) -> Optional[EvalReport]:
        """The engine now holds ``version``: start a round for the newest point it covers, if none is running.
        Returns the report at once when this worker's shard is empty (more workers than eval prompts)."""
        if self._skip_until_loaded:
            if not loaded:
                return None
            while self._points and self._points[0] < version:  # points before the checkpoint are history
                self._points.popleft()
            self._skip_until_loaded = False
        if self._round is not None or not self._points or self._points[0] > version:
            return None
        point = self._points.popleft()
        while self._points and self._points[0] <= version:  # several points passed at once: evaluate the newest
            point = self._points.popleft()
        self._round = self._new_round(point, version)
        return self._complete() if not self._round.queue else None

    def _new_round(self, point: int, version: int) -> _Round:
        """Every set's greedy groups first, then the sampled ones, each taken from the sets in turn, so the sets
        progress alike through the round (and the greedy numbers, one answer per prompt, are done first)."""
        greedy: list[list] = []
        sampled: list[list] = []
        for name, held_out in self.sets.items():
            greedy.append([])
            sampled.append([])
            for item in held_out.dataset.items:
                specs = (("g", greedy[-1], SamplingSpec(n=1, max_tokens=held_out.max_tokens, temperature=0.0)),
                         ("s", sampled[-1], SamplingSpec(n=held_out.samples, max_tokens=held_out.max_tokens,
                                                         temperature=self.temperature, top_p=self.top_p,
                                                         top_k=self.top_k,
                                                         seed=held_out.sample_seed(item.index, point))))
                for tag, entries, spec in specs:
                    if spec.n:
                        key = f"{KEY_PREFIX}{point}:{name}:{item.index}:{tag}"
                        entries.append((key, name, item, spec))
        queue = collections.deque(_in_turn(greedy) + _in_turn(sampled))
        log.info("worker %d: evaluation of point %d at version %d (%d engine groups)", self.worker_id, point,
                 version, len(queue))
        return _Round(point, version, queue, 0, {name: FileScores() for name in self.sets}, version)

    def admit(self, engine) -> None:
        """Add evaluation groups while they fit in the evaluation's share of the engine. A group larger than the
        whole share (``data.eval_samples`` > ``max_num_seqs // 2``) goes in alone when no evaluation group is in
        flight: refused forever, it would leave the round unfinished and, since weights load between rounds, the
        worker on its old weights."""
        r = self._round
        while r is not None and r.queue and (self._inflight_seqs == 0
                                             or self._inflight_seqs + r.queue[0][3].n <= self.budget):
            key, name, item, spec = r.queue[0]
            if self.sets[name].episodes:
                if self.start_episodes is None:
                    raise RuntimeError(f"evaluation: {name!r} holds episodes, and this worker plays none")
                self.start_episodes(key, item, spec)
            else:
                engine.add_group(key, item.prompt_ids, spec)
            r.queue.popleft()
            r.outstanding += 1
            self._inflight_seqs += spec.n
            self._answers[key] = (getattr(item, "answer", ""), spec.n)

    @property
    def active(self) -> bool:
        return self._round is not None

    @staticmethod
    def owns(key: str) -> bool:
        return key.startswith(KEY_PREFIX)

    def finished(self, done: FinishedGroup) -> Optional[EvalReport]:
        """Score one finished evaluation group; returns the report when it completes the round. A group of
        episodes that a faulty environment dropped counts its ``n`` answers as failures (reward 0, no tokens)."""
        r = self._round
        answer, n = self._answers.pop(done.key)
        _, _point, rest = done.key.split(":", 2)
        name, _index, tag = rest.rsplit(":", 2)
        scores, held = r.scores[name], self.sets[name]
        # an agent's earlier branches kept as samples (env.agent_branches=all) are not answers: each episode is one
        answers = [(self._reward(held, c, answer), len(c.token_ids)) for c in done.completions
                   if getattr(c, "ended", "") != "branch"]
        if held.episodes and getattr(done, "dropped", False):
            answers = [(0.0, 0)] * n
        for reward, tokens in answers:
            solved = int(held.episodes and reward > 0)  # an episode's success: its task solved (reward > 0)
            if tag == "g":
                scores.prompts += 1
                scores.greedy_reward += float(reward)
                scores.greedy_success += solved
            else:
                scores.sampled += 1
                scores.sampled_reward += float(reward)
                scores.sampled_success += solved
            scores.tokens += tokens
            scores.answers += 1
            scores.episodes += int(held.episodes)
        for c in done.completions:
            if c.versions is not None and len(c.versions):
                r.version_max = max(r.version_max, int(max(c.versions)))
        self._inflight_seqs -= n
        r.outstanding -= 1
        if r.outstanding or r.queue:
            return None
        return self._complete()

    def _reward(self, held: EvalSet, c, answer: str) -> float:
        """One answer's reward: an episode's is its environment's (the sum of its turn rewards); a single turn's
        is the exact-answer check (the task's probe) or the run's reward function over the decoded text."""
        if held.episodes:
            return float(c.reward)
        text = self._decode(c.token_ids)
        if held.exact:
            return float(is_exact_answer(text, answer, ended=c.finish_reason == "stop"))
        return float(self._score(self._reward_fn, text, answer)[0])

    def _complete(self) -> EvalReport:
        r, self._round = self._round, None
        return EvalReport(point=r.point, worker_id=self.worker_id, version_min=r.version, version_max=r.version_max,
                          files=r.scores)


def _in_turn(lists: list[list]) -> list:
    """One entry from each list in turn until all are used up."""
    return [entry for row in itertools.zip_longest(*lists) for entry in row if entry is not None]


def eval_sets(cfg, tokenizer, worker_id: int, num_workers: int) -> dict:
    """Every held-out set this worker measures, by report name: the task's probe (:data:`TASK_SET`, logged as
    ``eval/<metric>``) and each eval file's shard (``eval/<file>/<metric>``)."""
    sets: dict = {}
    task = task_eval_set(cfg, tokenizer, worker_id, num_workers)
    if task is not None:
        sets[TASK_SET] = task
    sets.update(eval_file_sets(cfg, tokenizer, worker_id, num_workers, reserved=(TASK_SET,)))
    return sets


def build_eval_runner(cfg, worker_id: int, num_workers: int, tokenizer, decode, reward_fn) -> Optional[EvalRunner]:
    """An :class:`EvalRunner` for this worker's shard of the run's held-out sets, or None when there are none."""
    sets = eval_sets(cfg, tokenizer, worker_id, num_workers)
    if not sets:
        return None
    return EvalRunner(cfg, sets, worker_id, decode, reward_fn, score_safely, resumed=bool(cfg.trainer.resume_from))
