"""A config dataclass's fields as command-line flags: the field is the one place its name, type and help live.

    parser = argparse.ArgumentParser()
    for name in ("model", "n_samples", "hub"):
        add_field_flag(parser, EvalOptions, name)  # --model, --n-samples N, --hub / --no-hub
    given = {k: v for k, v in vars(parser.parse_args()).items() if v is not None}

Every flag defaults to None (not given), so that a value from a config file stays unless the flag is passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal


def add_field_flag(parser: argparse.ArgumentParser, cls: type, name: str, *, with_default: bool = False) -> None:
    """``--name-with-dashes`` for field ``name`` of ``cls``: its help line, and the parse its annotation asks
    for (a bool is ``--x`` / ``--no-x``, a ``list[T]`` is given once per item, a ``Literal`` lists its choices).
    ``with_default``: the flag's default is the field's (a command without a config file under it)."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is None:
        raise ValueError(f"add_field_flag: expects a field of {cls.__name__}, got {name!r}")
    kind = _parse_of(typing.get_type_hints(cls)[name], f"{cls.__name__}.{name}")
    text = field_help(f, with_default=not with_default) + (" (repeatable)" if kind.get("action") == "append" else "")
    default = f.default if with_default else None
    parser.add_argument("--" + name.replace("_", "-"), default=default, help=text, **kind)


def field_help(f: dataclasses.Field, with_default: bool = True) -> str:
    """The field's help line, with its default when that says something (not None, empty or False)."""
    text = f.metadata.get("help", "")
    if with_default and f.default not in (None, "", False, dataclasses.MISSING):
        text += f" (default {f.default})"
    return text.replace("%", "%%")  # argparse formats help with %


def _parse_of(hint: Any, where: str) -> dict[str, Any]:
    """argparse's ``type``/``action``/``choices`` for an annotation (``X | None`` parses as ``X``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            hint = args[0]
    origin = typing.get_origin(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if hint in (str, int, float):
        return {} if hint is str else {"type": hint}
    if origin is Literal:
        return {"choices": list(typing.get_args(hint))}
    if origin is list and typing.get_args(hint)[0] in (str, int, float):
        item = typing.get_args(hint)[0]
        return {"action": "append", **({} if item is str else {"type": item})}
    raise TypeError(f"{where}: no command-line flag for a field of type {hint}")
