"""`ToolEnv`: give any `TextEnv` tools, plain Python functions called by the model.

A function's signature and Google-style docstring become a JSON schema, listed after the first
observation. Calls are parsed from the Qwen/Hermes format ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``; results come back as the next observation (chat role ``tool``) inside
``<tool_response>...</tool_response>``, and the wrapped env does not step. A bad call (malformed JSON, an
unknown tool, wrong arguments, an exception inside the tool) is reported to the model; the episode goes on.
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

from areal_agents.envs.base import text_space
from areal_agents.sandbox import LocalSandbox, Sandbox

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
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


def find_tool_calls(text: str) -> list[str]:
    """The raw JSON of each ``<tool_call>...</tool_call>`` in a model reply, in order."""
    return _CALL.findall(text)


def tools_prompt(schemas: list[dict[str, Any]]) -> str:
    """The tool list and calling convention, as the model reads it."""
    listed = "\n".join(json.dumps(s) for s in schemas)
    return (
        "You may call these tools:\n<tools>\n" + listed + "\n</tools>\n"
        'To call one, write <tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>.'
    )


def call_tool(tools: dict[str, Callable[..., Any]], raw: str, max_result_chars: int = 4000) -> str:
    """Run one call (its raw JSON) and return the result as text; every mistake becomes an error message."""
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"error: the tool call is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'error: a tool call needs {"name": ..., "arguments": {...}}'
    fn = tools.get(call["name"])
    if fn is None:
        return f"error: unknown tool {call['name']!r}; tools: {', '.join(tools)}"
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments JSON-encoded
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "error: arguments is a string that is not valid JSON"
    if not isinstance(arguments, dict):
        return "error: arguments must be a JSON object"
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return f"error: bad arguments for {fn.__name__}: {e}"
    try:
        result = fn(**arguments)
    except Exception as e:
        return f"error: {fn.__name__} raised {type(e).__name__}: {e}"
    text = result if isinstance(result, str) else json.dumps(result, default=repr)
    return text if len(text) <= max_result_chars else text[:max_result_chars] + "...[truncated]"


class ToolEnv(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Wraps a text env; tool calls are answered here, other actions step the wrapped env."""

    def __init__(
        self, env: gym.Env, tools: list[Callable[..., Any]], *, max_tool_calls: int = 8, max_result_chars: int = 4000
    ) -> None:
        gym.utils.RecordConstructorArgs.__init__(
            self, tools=tools, max_tool_calls=max_tool_calls, max_result_chars=max_result_chars
        )
        gym.Wrapper.__init__(self, env)
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
        calls = find_tool_calls(action)
        if not calls:
            return self.env.step(action)
        responses = []
        for raw in calls:
            if self.tool_calls >= self.max_tool_calls:
                responses.append(f"error: no tool calls left (limit {self.max_tool_calls}); give your answer")
                break
            self.tool_calls += 1
            responses.append(call_tool(self.tools, raw, self.max_result_chars))
        observation = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in responses)
        return observation, 0.0, False, False, {"role": "tool", "tool_calls": self.tool_calls}


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
