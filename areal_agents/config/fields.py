"""`config_field` (a dataclass field with a help line) and the value checks the config sections share."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def config_field(text: str, **kw: Any) -> Any:
    """A dataclass field with a one-line help text (shown by ``areal-agents CMD --help-config``)."""
    return field(metadata={"help": text}, **kw)


def check_positive(obj: Any, *names: str, or_zero: bool = False) -> None:
    """`ValueError` naming the first of ``names`` (attributes of ``obj``) that is negative, or 0 unless ``or_zero``."""
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not or_zero):
            raise ValueError(f"{name}: expects a value {'>=' if or_zero else '>'} 0, got {value!r}")
