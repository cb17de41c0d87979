"""Resolve ``module:attr`` strings from config (user envs, reward functions, dataset classes), and find an
interpreter that can import a module (an engine's own environment)."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from areal_agents.errors import ArealAgentsError, EngineError

# The modules a `module:Name` string (an env id, a kwarg naming an object) may name while `only_modules` is
# active, i.e. while an env server makes a client's env; None: any.
_allowed_modules: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "allowed_env_modules", default=None
)


@contextlib.contextmanager
def only_modules(modules: Iterable[str]) -> Iterator[None]:
    """Within this block `load_object` (and so `make_env`) resolves ``module:Name`` only for ``modules``
    (already imported) and imports nothing a caller names: an env server makes its clients' envs inside it."""
    token = _allowed_modules.set(frozenset(modules))
    try:
        yield
    finally:
        _allowed_modules.reset(token)


def module_allowed(module: str) -> bool:
    """Whether a ``module:Name`` string may name ``module`` here: always, except inside `only_modules`
    (an env server making a client's env), where only its start-up modules may be named."""
    allowed = _allowed_modules.get()
    return allowed is None or module in allowed


def load_object(spec: str, what: str = "object") -> Any:
    """The attribute ``attr`` of module ``module`` for ``spec = "module:attr"`` (dots allowed in attr)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ArealAgentsError(f"{what} {spec!r}: expects the form 'package.module:Name'")
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


def python_with(module: str, configured: str, key: str, hint: str) -> str:
    """The interpreter ``configured`` (a config ``key``'s value; empty: this one) after checking that it can
    import ``module``: an engine (SGLang, vLLM) that lives in an environment of its own. `EngineError`
    naming ``key`` and ending with ``hint`` (how to make such an environment) when it cannot."""
    python = configured or sys.executable
    if configured and not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise EngineError(f"{key}: {python} is not an executable file; {hint}")
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    if subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode != 0:
        where = key if configured else f"this interpreter ({key} is unset)"
        raise EngineError(f"{where} ({python}) has no {module} module; {hint}")
    return python


def lazy_exports(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` that imports ``name`` from its submodule ``homes[name]`` on first
    use, so importing the package (to build the CLI's parser, say) does not import its heavy modules."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)

    return __getattr__
