"""The calculator task written with the OpenAI Agents SDK (``pip install openai-agents``), launched unchanged.

``asyncppo launch data=calculator_agent env.agent=examples.agents.calculator_agents_sdk:agent``. The SDK's own
loop runs the agent: it calls the model through the client asyncppo hands it (the episode's session), runs the
``calc`` function tool when the model calls it, and stops at the first reply without a call. Nothing here knows it
is being trained; the one asyncppo-specific line is the choice of the Chat Completions model class with the given
client (the SDK's default is the Responses API, which the endpoint does not serve). The tool is declared with the
task's own schema (``CALC_TOOL``), so that the prompt the SDK sends renders as the one the tiny model was warm-started
on; a tool built with ``@function_tool`` works the same way, with a longer schema in the prompt.
"""

from __future__ import annotations

from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

from asyncppo.data.calculator import CALC_TOOL
from examples.agents.calculator_openai import run_tool

set_tracing_disabled(True)  # the SDK would upload traces to OpenAI; nothing leaves the machine


async def run_calc(ctx, arguments: str) -> str:
    return run_tool(arguments)  # the plain agent's tool: the same evaluation, the same error replies


calc = FunctionTool(name="calc", description=CALC_TOOL["function"]["description"],
                    params_json_schema=CALC_TOOL["function"]["parameters"], on_invoke_tool=run_calc,
                    strict_json_schema=False)


async def agent(client, row: dict) -> float:
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    solver = Agent(name="calculator", model=model, tools=[calc])
    result = await Runner.run(solver, row["prompt"], max_turns=3)
    return float(str(result.final_output).strip() == row["answer"])
