"""Synthetic tool-use conversations: arithmetic solved by calling ``add`` / ``multiply``, then answering.

The SFT warm start that teaches a tiny model its family's tool-call format (issue 31, item 6): each
conversation is OpenAI messages — the user's problem (``"37+58="``, as ``areal_agents/Arithmetic-v0`` poses
it), an assistant turn with one structured call (and a short ``reasoning_content`` for reasoning families),
the ``tool`` result, and the final answer. `areal-agents sft` renders them through the model's own chat
template, so the model learns the call format its family's parser reads.

    conversations = tool_use_conversations(1000, seed=0, reasoning=True)
    tools = TOOL_SCHEMAS  # the `tools=` of the chat template; the same functions serve RL through ToolAgent
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from areal_agents.chat.replies import new_call_id


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a * b


TOOLS: dict[str, Callable[[int, int], int]] = {"+": add, "*": multiply}


def _schema(fn: Callable[..., Any], description: str) -> dict[str, Any]:
    numbers = {"a": {"type": "integer", "description": "the first number."}}
    numbers["b"] = {"type": "integer", "description": "the second number."}
    parameters = {"type": "object", "properties": numbers, "required": ["a", "b"]}
    return {"type": "function", "function": {"name": fn.__name__, "description": description, "parameters": parameters}}


# What `areal_agents.envs.tools.tool_schema` makes of the two functions (tests/test_family_tool_use.py checks).
TOOL_SCHEMAS: list[dict[str, Any]] = [_schema(add, "Add two integers."), _schema(multiply, "Multiply two integers.")]

# Families whose tool-use turns carry reasoning: Mistral Nemo's format has none, and Granite 3.3's system prompt
# with tools asks for the call alone (its thinking prompt is only for turns without tools); the others write a
# think block (gpt-oss: the analysis channel) before the call.
REASONING: dict[str, bool] = {
    "qwen3": True,
    "qwq": True,
    "deepseek-r1": True,
    "mistral": False,
    "gpt-oss": True,
    "granite": False,
}


def tools_for(operators: str) -> list[dict[str, Any]]:
    """The schemas of the tools ``operators`` needs, in `TOOL_SCHEMAS` order (what ``ToolAgent`` lists for the
    same functions); ``module:function`` names for ``rollout.agent_kwargs.tools`` are `tool_names`."""
    return [s for op, s in zip(TOOLS, TOOL_SCHEMAS) if op in operators]


def tool_names(operators: str) -> list[str]:
    """``rollout.agent_kwargs.tools`` for ``operators``: the same tools as `tools_for`."""
    return [f"{__name__}:{fn.__name__}" for op, fn in TOOLS.items() if op in operators]


def tool_use_conversation(
    a: int, op: str, b: int, *, reasoning: bool, call_id: str | None = None, system: str | None = None
) -> list[dict]:
    """One conversation for ``a op b``: call the operator's tool, read its result, answer with it; ``system``
    opens it with that system message (the prompt the agent will pose, e.g. its tool listing)."""
    if op not in TOOLS:
        raise ValueError(f"Expects op to be one of {sorted(TOOLS)}, got {op!r}")
    fn = TOOLS[op]
    call_id = call_id or new_call_id()  # 9 alphanumerics: Mistral's template insists on them
    result = str(fn(a, b))
    call = {"id": call_id, "type": "function", "function": {"name": fn.__name__, "arguments": {"a": a, "b": b}}}
    calling: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
    answering: dict[str, Any] = {"role": "assistant", "content": result}
    if reasoning:
        calling["reasoning_content"] = f"I call {fn.__name__}."
        answering["reasoning_content"] = "The tool gave the answer."
    opening = [{"role": "system", "content": system}] if system else []
    return [
        *opening,
        {"role": "user", "content": f"{a}{op}{b}="},
        calling,
        {"role": "tool", "tool_call_id": call_id, "name": fn.__name__, "content": result},
        answering,
    ]


def tool_use_conversations(
    n: int,
    *,
    seed: int,
    reasoning: bool,
    digits: int = 1,
    operators: str = "+*",
    keep: Callable[[str], bool] | None = None,
    system: str | None = None,
) -> Iterator[list[dict]]:
    """``n`` conversations on uniform ``digits``-digit operands; ``keep(problem_text)`` filters problems
    (e.g. to the env's train split); ``system`` as in `tool_use_conversation`."""
    if not operators or set(operators) - set(TOOLS):
        raise ValueError(f"Expects operators to be a non-empty string of {''.join(TOOLS)!r}, got {operators!r}")
    rng = random.Random(seed)
    made = 0
    while made < n:
        a, b, op = rng.randrange(10**digits), rng.randrange(10**digits), rng.choice(operators)
        if keep is not None and not keep(f"{a}{op}{b}="):
            continue
        # One call a conversation: its id needs to be unique only there, and a fixed one is a pattern a tiny
        # model learns at once (random ones it writes at the wrong length, which Mistral's template rewrites).
        yield tool_use_conversation(a, op, b, reasoning=reasoning, call_id="call00001", system=system)
        made += 1
