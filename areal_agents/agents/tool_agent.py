"""`ToolAgent`: a `ChatAgent` with its own tools (Python functions), called in the model family's own format.

The env poses the task; the tool calls the reply's parser finds (Hermes/Qwen ``<tool_call>``, Mistral
``[TOOL_CALLS]``, DeepSeek's tool tokens, gpt-oss harmony, Granite ``<|tool_call|>``) are answered by the agent
as ``tool`` messages without stepping the env, and a reply without a call is the action. A malformed call is
answered with its parse error, so the model can correct it. Tool results are prompt tokens: never in the loss
mask. A template that lists tools itself (``tools`` in the template) gets their schemas; otherwise the system
prompt lists them with the call syntax of the reply parser's format.

    agent = ToolAgent(engine, tokenizer, SamplingParams(max_new_tokens=64), tools=[add, python_runner()])
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.chat.replies import ParsedReply, new_call_id
from areal_agents.envs.tools import call_tool, tool_schema, tools_prompt
from areal_agents.errors import ConfigError
from areal_agents.importing import load_object


class ToolAgent(ChatAgent):
    """Tools run in a thread (they may block: a sandbox, a search call); at most ``max_tool_calls`` a turn.
    ``tools`` are functions or ``module:function`` names (as ``rollout.agent_kwargs`` gives them)."""

    def __init__(
        self,
        *args: Any,
        tools: list[Callable[..., Any] | str],
        max_tool_calls: int = 8,
        max_result_chars: int = 4000,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        functions = [load_object(t, "rollout.agent_kwargs.tools") if isinstance(t, str) else t for t in tools]
        for fn in functions:
            if not callable(fn):
                raise ConfigError(f"rollout.agent_kwargs.tools: {fn!r} is not a function")
        self.tools = {fn.__name__: fn for fn in functions}
        self.max_tool_calls, self.max_result_chars = max_tool_calls, max_result_chars
        schemas = [tool_schema(fn) for fn in functions]
        self._tool_without_call = _renders_tool_without_call(self.tokenizer)
        template = self.tokenizer.chat_template or ""
        self._template_knows_tools = any(k in template for k in ("tools", "'tool'", '"tool"'))
        if "tools" in (self.tokenizer.chat_template or ""):
            self.tool_schemas = schemas  # the template lists them in its own format
        else:
            listing = tools_prompt(schemas, self.parser.tool_parser)
            self.system_prompt = f"{self.system_prompt}\n\n{listing}" if self.system_prompt else listing

    async def answer(self, reply: ParsedReply, text: str) -> list[dict[str, Any]] | None:
        if not reply.tool_calls and not reply.errors:
            return None
        messages = []
        for call in reply.tool_calls[: self.max_tool_calls]:
            result = await asyncio.to_thread(call_tool, self.tools, call, self.max_result_chars)
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result})
        if reply.tool_calls or self._tool_without_call:  # a fresh id: Mistral's template wants one on every result
            messages += [{"role": "tool", "tool_call_id": new_call_id(), "content": str(e)} for e in reply.errors]
        else:
            messages += [{"role": "user", "content": str(e)} for e in reply.errors]
        if len(reply.tool_calls) > self.max_tool_calls:
            limit = f"error: at most {self.max_tool_calls} tool calls a turn; the rest were not run"
            messages.append({"role": "tool", "content": limit})
        if not self._template_knows_tools:  # ChatML and the like: results in Hermes's tags, as one message
            return [
                {
                    "role": "tool",
                    "content": "\n".join(f"<tool_response>\n{m['content']}\n</tool_response>" for m in messages),
                }
            ]
        return messages


def _renders_tool_without_call(tokenizer: Any) -> bool:
    """Whether the chat template takes a tool message after a reply without a call (gpt-oss's refuses it: a
    malformed call's error then comes back as a user message)."""
    probe = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "tool_call_id": new_call_id(), "content": "error"},
    ]
    try:
        tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001  (the template's raise_exception: TemplateError, or a TypeError of its own)
        return False
    return True
