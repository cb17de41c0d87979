"""`ToolAgent`: a `ChatAgent` with its own tools (Python functions), in `ToolEnv`'s call format.

The env poses the task; tool calls in a reply (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)
are answered by the agent as a ``tool`` message without stepping the env, and a reply without a call is
the action. Tool results are prompt tokens: never in the loss mask.

    agent = ToolAgent(engine, tokenizer, SamplingParams(max_new_tokens=64), tools=[add, python_runner()])
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.envs.tools import call_tool, find_tool_calls, tool_schema, tools_prompt


class ToolAgent(ChatAgent):
    """Tools run in a thread (they may block: a sandbox, a search call); at most ``max_tool_calls`` a turn."""

    def __init__(
        self,
        *args: Any,
        tools: list[Callable[..., Any]],
        max_tool_calls: int = 8,
        max_result_chars: int = 4000,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.tools = {fn.__name__: fn for fn in tools}
        self.max_tool_calls, self.max_result_chars = max_tool_calls, max_result_chars
        listing = tools_prompt([tool_schema(fn) for fn in tools])
        self.system_prompt = f"{self.system_prompt}\n\n{listing}" if self.system_prompt else listing

    async def respond(self, text: str) -> tuple[str, str] | None:
        calls = find_tool_calls(text)[: self.max_tool_calls]
        if not calls:
            return None
        results = [await asyncio.to_thread(call_tool, self.tools, raw, self.max_result_chars) for raw in calls]
        return "tool", "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
