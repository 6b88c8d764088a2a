"""The rollout worker of an agent run (``env.agent``): the episode worker, with the HTTP endpoint in front of its
engine and one :class:`~asyncppo.agents.episode.AgentEpisode` per episode instead of a text environment.

Everything else is the episode worker's (:mod:`asyncppo.envs.episode_worker`): the draws, the groups of ``n``
episodes per row, the admission tickets and the window, the weight pushes landing between engine steps (calls go on
across them: every token keeps the version that sampled it), the trajectory records.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from asyncppo.agents.episode import AgentEpisode
from asyncppo.agents.host import load_function
from asyncppo.agents.server import AgentServer
from asyncppo.data.text_rows import TextEnvRow
from asyncppo.envs.episode_worker import EpisodeRolloutWorker
from asyncppo.rollout.engine import SamplingSpec

#: Seconds an episode's blocked wait lasts past ``env.step_timeout_s`` before its thread gives up (the runner ended
#: the episode at the deadline already; this only frees the thread).
WAIT_GRACE_S = 5.0


def agent_row(row: Any, env_config: dict) -> dict:
    """The dataset row as the agent sees it: a task row's ``prompt``/``answer``/``index``, or a SkyRL row's fields
    with ``prompt`` its chat messages; ``env_config`` is ``env.text_env_config`` (the agent's own settings)."""
    if isinstance(row, TextEnvRow):
        return {**row.episode_extras(), "prompt": [dict(m) for m in row.prompt_messages], "index": row.index,
                "env_config": env_config}
    return {"prompt": row.prompt, "answer": row.answer, "index": row.index, "env_config": env_config}


class AgentRolloutWorker(EpisodeRolloutWorker):
    """:class:`EpisodeRolloutWorker` whose episodes are runs of the user's agent program (module docstring)."""

    def _open_workload(self) -> None:
        self._open_server()  # first: the episode worker's announcement names the endpoint
        super()._open_workload()

    def _open_server(self) -> None:
        e = self.cfg.env
        self.reward_fn: Optional[Callable] = load_function(e.reward_fn, "env.reward_fn") if e.reward_fn else None
        tokenizer = self.tokenizer

        def stop_token_id(text: str) -> Optional[int]:
            ids = tokenizer.encode(text, add_special_tokens=False)
            return int(ids[0]) if len(ids) == 1 else None

        self.server = AgentServer(e.agent, host=e.agent_host, port=e.agent_port, key=None,
                                  max_body_bytes=e.agent_max_body_bytes, model_name=str(self.cfg.model.path),
                                  max_concurrency=e.max_concurrency, stop_token_id=stop_token_id,
                                  vocab_size=len(tokenizer), branches=e.agent_branches).start()
        self._closables.append(self.server)
        self.stats["agent_endpoint"] = self.server.url

    def _announce(self, num_prompts: int) -> None:
        super()._announce(num_prompts)
        print(f"[asyncppo] rollout worker {self.worker_id}: agent {self.cfg.env.agent} served at "
              f"{self.server.url}/sessions/<id>/v1 (OpenAI Chat Completions and Completions; a bearer key per run)", flush=True)

    def _start_episodes(self, key: str, row, spec: SamplingSpec) -> None:
        e = self.cfg.env
        row = agent_row(row, dict(e.text_env_config))
        episodes = [AgentEpisode(self.server, row, wait_s=e.step_timeout_s + WAIT_GRACE_S,
                                 tokenizer=self.tokenizer, reward_fn=self.reward_fn) for _ in range(spec.n)]
        self.engine.add_group(key, None, spec, episodes, prompt_messages=[])

    def _before_close(self) -> None:
        super()._before_close()
        server = getattr(self, "server", None)
        if server is not None:
            print(f"[asyncppo] rollout worker {self.worker_id}: agent calls answered {server.calls}, refused "
                  f"{dict(server.refusals) or 0}", flush=True)
