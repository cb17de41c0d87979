"""Resolve ``module:attr`` strings from config (user envs, reward functions, dataset classes)."""

from __future__ import annotations

import importlib
from typing import Any

from areal_agents.errors import ArealAgentsError


def load_object(spec: str, what: str = "object") -> Any:
    """The attribute ``attr`` of module ``module`` for ``spec = "module:attr"`` (dots allowed in attr)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ArealAgentsError(f"{what} {spec!r}: expects the form 'package.module:Name'")
    from areal_agents.envs.registry import module_allowed  # noqa: PLC0415  (envs import this module)

    if not module_allowed(module_name):
        raise ArealAgentsError(
            f"{what} {spec!r}: this env server imports no module a request names; start it with --module {module_name}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ArealAgentsError(f"{what} {spec!r}: cannot import module {module_name!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ArealAgentsError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
