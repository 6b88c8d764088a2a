"""Agent programs that e2e launches train through the endpoint (``env.agent=agent_programs:<name>``; tests/ is on
the path of a launch's actors, as for tests/episode_envs.py)."""

from __future__ import annotations


async def summarising_agent(client, row):
    """One call, then its context rewritten: the first reply replaced by a note of the agent's own (a new branch),
    and a second call there; the reward is 1 when that reply holds the row's answer (never, for a random model: the
    reward is the length of the reply over 100, so a group's samples differ)."""
    first = [{"role": "user", "content": row["prompt"]}]
    await client.chat.completions.create(model="policy", messages=first, max_tokens=6)
    rewritten = first + [{"role": "assistant", "content": "(a note)"}, {"role": "user", "content": "answer now"}]
    reply = await client.chat.completions.create(model="policy", messages=rewritten, max_tokens=6)
    text = reply.choices[0].message.content or ""
    return 1.0 if row["answer"] and row["answer"] in text else len(text) / 100.0
