"""Prompt templates an env takes as a kwarg (Math-v0's ``prompt_template``, Debate's ``round_prompt``), from a
config or an env server's client: plain ``{name}`` fields the env fills, each at most once, and no format spec,
conversion, index or attribute, within `MAX_TEMPLATE_CHARS`. So a rendered observation is at most the template
plus the env's own values: a template cannot pad it to any size (``{prompt:>300000000}``) or reach into an
object (``{prompt.__class__}``).

    check_template("Q: {prompt}\\nA:", "prompt_template", fields=("prompt",), required=("prompt",))
"""

from __future__ import annotations

import string
from collections.abc import Collection
from typing import Any

MAX_TEMPLATE_CHARS = 32768


def check_template(template: Any, what: str, fields: Collection[str], required: Collection[str] = ()) -> str:
    """``template`` when it is a bounded format string over ``fields`` with every ``required`` one; else a
    ValueError naming ``what`` and the fault (an env's constructor raising it is a client's 400)."""
    if not isinstance(template, str):
        raise ValueError(f"{what}: expects a string, got {type(template).__name__}")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{what}: {len(template)} characters; at most {MAX_TEMPLATE_CHARS}")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{what}: not a valid template ({e}); write a literal brace as {{{{ or }}}}") from None
    names = ", ".join("{" + f + "}" for f in fields)
    seen: set[str] = set()
    for _, field, spec, conversion in parts:
        if field is None:
            continue
        if field not in fields:
            raise ValueError(
                f"{what}: {{{field[:40]}}} is not a field it may use ({names}); write a literal brace as {{{{ or }}}}"
            )
        if spec or conversion:
            raise ValueError(f"{what}: {{{field}}} may not have a format spec or conversion; write it plain")
        if field in seen:
            raise ValueError(f"{what}: {{{field}}} appears more than once; it may appear once")
        seen.add(field)
    for field in required:
        if field not in seen:
            raise ValueError(f"{what}: expects a {{{field}}} placeholder")
    return template
