"""The built-in ``lookup`` task as an agent of the OpenAI Agents SDK (``openai-agents``), trained
unchanged through the run's endpoint:

    uv run --with openai-agents rlwire-train data.source=builtin:lookup \
        agent.function=examples.agents.lookup_agents_sdk:solve

The SDK runs the loop (model call, tool call, model call); the trainer gives it a client set to
the run (``client``) and trains on what the policy sampled in its calls. Why this framework: it
sits directly on the ``openai`` client (``OpenAIChatCompletionsModel`` takes an
``AsyncOpenAI``), so the run's client is all it needs.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
)

from rlwire.trainer.agent.lookup import lookup, lookup_reward, row_table

MAX_TURNS = 3


async def solve(row: dict[str, Any], client: Any) -> float:
    """One conversation of the lookup task with the Agents SDK; its reward."""
    table = row_table(row)

    @function_tool
    def lookup_code(key: str) -> str:
        """Look up the code stored under a key.

        Args:
            key: three letters from a to j, as given in the prompt.
        """
        return lookup(key, table=table)

    lookup_code.name = "lookup"  # the name the model was primed with
    agent = Agent(
        name="lookup",
        instructions=None,  # the tiny model's template has no system turn
        tools=[lookup_code],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(parallel_tool_calls=False),
    )
    try:
        result = await Runner.run(
            agent,
            row["prompt"],
            max_turns=MAX_TURNS,
            run_config=RunConfig(tracing_disabled=True),
        )
        final = str(result.final_output or "")
    except Exception:  # noqa: BLE001 - past MAX_TURNS (the SDK raises): no answer
        final = ""
    return lookup_reward([""], [final], [row["reward_model"]["ground_truth"]])[0]
