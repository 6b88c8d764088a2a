"""The guess game of ``data=guess`` behind a slow tool, written as an agent program (``asyncppo bench tool-latency
agent=true``).

The agent asks the model for a digit, then "looks it up" for ``row["env_config"]["latency_s"]`` seconds (awaited:
the CPU stays free, as for a remote tool) and answers ``higher`` / ``lower`` as a user turn, up to 4 guesses. The
hidden digit, the prompt and the rewards are those of :class:`asyncppo.envs.examples.GuessEnv`, so the rendered
episode is the environment's turn for turn: the benchmark compares the endpoint with the in-process loop on the same
game.
"""

from __future__ import annotations

import asyncio
import re
import zlib

MAX_GUESSES, HIGH = 4, 9


async def agent(client, row: dict) -> float:
    target = zlib.crc32(f"{row.get('prompt', '')}|{row.get('index', 0)}".encode()) % (HIGH + 1)
    latency_s = float((row.get("env_config") or {}).get("latency_s", 0.0))
    messages = [{"role": "user", "content": f"Guess my number, 0 to {HIGH}."}]
    for turn in range(1, MAX_GUESSES + 1):
        text = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        await asyncio.sleep(latency_s)
        found = re.search(r"\d+", text or "")
        if found is not None and int(found.group()) == target:
            return 1.0 - (turn - 1) / MAX_GUESSES
        reply = "Say a number." if found is None else ("higher" if int(found.group()) < target else "lower")
        messages.append({"role": "user", "content": reply})
    return 0.0
