"""`ToolEnv`: give any `TextEnv` tools, plain Python functions called by the model.

A function's signature and Google-style docstring become a JSON schema, listed after the first
observation. Calls are parsed in the model family's format (``tool_parser``: Qwen/Hermes ``<tool_call>{"name":
..., "arguments": {...}}</tool_call>`` by default, or mistral, deepseek, harmony, granite); results come back
as the next observation (chat role ``tool``) inside ``<tool_response>...</tool_response>``, and the wrapped env
does not step. A bad call (malformed JSON, an unknown tool, wrong arguments, an exception inside the tool) is
reported to the model, never dropped; the episode goes on.
An action without a tool call goes to the wrapped env.

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first number.
            b: the second number.
        \"\"\"
        return a + b

    env = ToolEnv(gymnasium.make("areal_agents/Arithmetic-v0"), tools=[add])
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from areal_agents.chat.parsers import TOOL_PARSERS, parse_reply
from areal_agents.chat.replies import ToolCall
from areal_agents.envs.base import text_space
from areal_agents.errors import ArealAgentsError
from areal_agents.sandbox import LocalSandbox, Sandbox

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation) or annotation
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {}
    if origin in _JSON_TYPES:
        schema: dict[str, Any] = {"type": _JSON_TYPES[origin]}
        if origin is list and typing.get_args(annotation):
            schema["items"] = _json_type(typing.get_args(annotation)[0])
        return schema
    return {}


def _arg_docs(doc: str) -> dict[str, str]:
    """Argument descriptions from a Google-style ``Args:`` section."""
    out: dict[str, str] = {}
    section = re.search(r"Args:\n(.*?)(?:\n\s*\n|\n\s*\w+:\n|$)", doc, re.DOTALL)
    if section:
        for m in re.finditer(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", section.group(1), re.MULTILINE):
            out[m.group(1)] = m.group(2).strip()
    return out


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """OpenAI-style function schema from ``fn``'s signature and docstring."""
    doc = inspect.getdoc(fn) or ""
    hints = typing.get_type_hints(fn)
    params, required = {}, []
    described = _arg_docs(doc)
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        params[name] = {
            **_json_type(hints.get(name, Any)),
            **({"description": described[name]} if name in described else {}),
        }
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc.split("\n\n")[0].strip(),
            "parameters": {"type": "object", "properties": params, "required": required},
        },
    }


# How a call is written in each format, for templates that do not list tools themselves (the model reads it).
CALL_SYNTAX = {
    "hermes": '<tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": <tool name>, "arguments": <arguments object>}]',
    "granite": '<|tool_call|>[{"name": <tool name>, "arguments": <arguments object>}]',
    "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><tool name>\n```json\n"
    "<arguments object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "harmony": "<|start|>assistant to=functions.<tool name><|channel|>commentary json<|message|><arguments object>",
}


def tools_prompt(schemas: list[dict[str, Any]], tool_parser: str = "hermes") -> str:
    """The tool list and calling convention (in ``tool_parser``'s format), as the model reads it."""
    listed = "\n".join(json.dumps(s) for s in schemas)
    syntax = CALL_SYNTAX.get(tool_parser, CALL_SYNTAX["hermes"])
    return f"You may call these tools:\n<tools>\n{listed}\n</tools>\nTo call one, write {syntax}."


def call_tool(tools: dict[str, Callable[..., Any]], call: ToolCall | str, max_result_chars: int = 4000) -> str:
    """Run one call (parsed, or its raw Hermes JSON) and return the result as text; every mistake becomes an
    error message."""
    if isinstance(call, str):
        reply = parse_reply(f"<tool_call>{call}</tool_call>", "hermes", "none")
        if reply.errors:
            return str(reply.errors[0])
        call = reply.tool_calls[0]
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r}; tools: {', '.join(tools)}"
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return f"error: bad arguments for {fn.__name__}: {e}"
    try:
        result = fn(**call.arguments)
    except Exception as e:
        return f"error: {fn.__name__} raised {type(e).__name__}: {e}"
    text = result if isinstance(result, str) else json.dumps(result, default=repr)
    return text if len(text) <= max_result_chars else text[:max_result_chars] + "...[truncated]"


class ToolEnv(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Wraps a text env; tool calls are answered here, other actions step the wrapped env."""

    def __init__(
        self,
        env: gym.Env,
        tools: list[Callable[..., Any]],
        *,
        max_tool_calls: int = 8,
        max_result_chars: int = 4000,
        tool_parser: str = "hermes",
    ) -> None:
        gym.utils.RecordConstructorArgs.__init__(
            self, tools=tools, max_tool_calls=max_tool_calls, max_result_chars=max_result_chars, tool_parser=tool_parser
        )
        gym.Wrapper.__init__(self, env)
        if tool_parser not in TOOL_PARSERS or tool_parser == "none":
            choices = ", ".join(p for p in TOOL_PARSERS if p != "none")
            raise ArealAgentsError(f"tool_parser: expects one of {choices}, got {tool_parser!r}")
        self.tool_parser = tool_parser
        self.tools = {fn.__name__: fn for fn in tools}
        self.schemas = [tool_schema(fn) for fn in tools]
        self.max_tool_calls, self.max_result_chars = max_tool_calls, max_result_chars
        self.tool_calls = 0
        # Observations now carry the tool list, or up to max_tool_calls responses.
        inner = getattr(env.observation_space, "max_length", 4096)
        widest = max(inner + len(self.tools_prompt()) + 2, (max_result_chars + 64) * max_tool_calls)
        self.observation_space = text_space(widest)

    def tools_prompt(self) -> str:
        return tools_prompt(self.schemas)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        observation, info = self.env.reset(seed=seed, options=options)
        self.tool_calls = 0
        return f"{observation}\n\n{self.tools_prompt()}", info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        reply = parse_reply(action, self.tool_parser, "none")
        if not reply.tool_calls and not reply.errors:
            return self.env.step(action)
        responses = []
        for call in reply.tool_calls:
            if self.tool_calls >= self.max_tool_calls:
                responses.append(f"error: no tool calls left (limit {self.max_tool_calls}); give your answer")
                break
            self.tool_calls += 1
            responses.append(call_tool(self.tools, call, self.max_result_chars))
        responses += [str(error) for error in reply.errors]  # a malformed call is answered, never dropped
        observation = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in responses)
        info = {"role": "tool", "tool_calls": self.tool_calls, "tool_parse_failures": len(reply.errors)}
        return observation, 0.0, False, False, info


def python_runner(sandbox: Sandbox | None = None, timeout_s: float = 5.0) -> Callable[..., str]:
    """The sandboxed code runner as a tool: ``run_python(code, stdin="")``."""
    box = sandbox if sandbox is not None else LocalSandbox()

    def run_python(code: str, stdin: str = "") -> str:
        """Run Python code in an isolated sandbox and return its status, stdout and stderr.

        Args:
            code: the Python program to run.
            stdin: text given to the program on standard input.
        """
        r = box.run(code, stdin=stdin, timeout_s=timeout_s)
        return f"status: {r.status}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"

    return run_python
