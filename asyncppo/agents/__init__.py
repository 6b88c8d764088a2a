"""Agents people already wrote, trained through an OpenAI-compatible endpoint on the rollout engines (docs/agents.md).

With ``env.agent=pkg.module:function`` each rollout worker serves the Chat Completions API from its engine
(:mod:`asyncppo.agents.server`), gives every episode a session URL (:mod:`asyncppo.agents.session`) and plays the
user's agent program as the episode's "environment" (:mod:`asyncppo.agents.episode`): the program's calls are the
model turns, and the messages it adds between two calls (tool results, user turns) are the environment's turns. The
token rule of :mod:`asyncppo.envs.chat` holds: past assistant turns are the ids the engine sampled, never decoded
and re-tokenized.
"""
