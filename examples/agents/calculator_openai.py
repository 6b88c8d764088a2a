"""The calculator task as an agent program: a plain loop over the OpenAI client, no asyncppo in its logic.

Launch (repository root): ``asyncppo launch data=calculator_agent`` (``env.agent=examples.agents.calculator_openai:
agent``). The agent asks the model with the ``calc`` tool; each tool call is answered with the evaluated expression,
and the first reply without a call is the final answer: reward 1 when it is the row's product, else 0. The rows,
the tool's schema and the safe evaluator are the task's own (asyncppo.data.calculator), so the rendered episode is
the built-in environment's (asyncppo.envs.calculator) turn for turn. One difference: a reply whose tool call does not
parse comes back as text (that is what the API gives an agent), so it is read as the final answer.
"""

from __future__ import annotations

import json

from asyncppo.data.calculator import CALC_TOOL, evaluate_expression


def run_tool(arguments: str) -> str:
    try:
        return str(evaluate_expression(json.loads(arguments).get("expr")))
    except (ValueError, AttributeError) as e:
        return f"error: {e}"


async def agent(client, row: dict) -> float:
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:  # the run's env.max_turns ends an agent that never answers
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[CALC_TOOL])
                 ).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return float((reply.content or "").strip() == row["answer"])
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.arguments)})
