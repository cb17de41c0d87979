"""The built-in env ids, and making envs by gymnasium id, with a clear error and a near-match suggestion for
unknown ids."""

from __future__ import annotations

import importlib
import re
import traceback
from typing import Any

import gymnasium as gym

from areal_agents.envs.multi_agent import MultiAgentTextEnv
from areal_agents.errors import ArealAgentsError, UnknownEnvError, did_you_mean
from areal_agents.importing import module_allowed

BUILTIN_ENVS = {
    "areal_agents/Arithmetic-v0": "areal_agents.envs.arithmetic:ArithmeticEnv",
    "areal_agents/Count-v0": "areal_agents.envs.count:CountEnv",
    "areal_agents/Math-v0": "areal_agents.envs.math:MathEnv",
    "areal_agents/Code-v0": "areal_agents.envs.code:CodeEnv",
    "areal_agents/Debate-v0": "areal_agents.envs.debate:DebateEnv",
}


def register_builtin_envs() -> None:
    """Register the built-in ids with gymnasium (once; their modules load when an env is made)."""
    for env_id, entry in BUILTIN_ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry)


def import_env_module(module: str) -> None:
    """Import a user module whose import registers env ids (``env.module`` in config, ``--module``).

    Any exception while importing becomes an `ArealAgentsError` naming the module, the error and where it
    was raised, so the CLI prints one line."""
    if not module:
        return
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ArealAgentsError(f"env.module {module!r} cannot be imported: {e}") from None
    except Exception as e:
        raise ArealAgentsError(f"env.module {module!r} failed while importing: {_described(e)}") from None


def _described(e: Exception) -> str:
    """``Type: message (file:line)``: a SyntaxError's own position, else the frame that raised."""
    if isinstance(e, SyntaxError):
        return f"{type(e).__name__}: {e.msg} ({e.filename}:{e.lineno})"
    frames = traceback.extract_tb(e.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


def modules_for(env_id: str, module: str = "") -> list[str]:
    """The modules an env server must import at start to serve ``env_id``: ``module`` (``env.module``)
    and the module of a ``module:Name`` id. A server imports no module named in a request."""
    id_module = env_id.split(":", 1)[0] if ":" in env_id else ""
    return [m for m in dict.fromkeys((module, id_module)) if m]


def _resolve(env_id: str) -> str:
    """Registered id for ``env_id``; ``module:Name`` imports ``module`` and takes its id or Env class."""
    if env_id in gym.registry or ":" not in env_id:
        return env_id
    module, attr = env_id.split(":", 1)
    if not module_allowed(module):
        raise UnknownEnvError(
            f"unknown env id {env_id!r}: this env server imports no module a request names, and {module!r} is "
            f"not one of its start-up modules; start it with --module {module}.{did_you_mean(env_id, gym.registry)}"
        )
    import_env_module(module)
    if attr in gym.registry:
        return attr
    target = getattr(importlib.import_module(module), attr, None)
    if isinstance(target, type) and issubclass(target, gym.Env | MultiAgentTextEnv):
        gym.register(id=env_id, entry_point=target)  # "module:Class" is a valid gymnasium id
        return env_id
    raise UnknownEnvError(f"{env_id!r}: module {module!r} has no registered id or gymnasium.Env class {attr!r}")


def make_env(env_id: str, **kwargs: Any) -> gym.Env | MultiAgentTextEnv:
    """``gymnasium.make(env_id, **kwargs)``; ``env_id`` may be ``module:Class`` or ``module:RegisteredId``.

    An unknown id raises `UnknownEnvError` (with a near match), bad kwargs `ArealAgentsError`.
    """
    resolved = _resolve(env_id)
    if resolved not in gym.registry:
        raise UnknownEnvError(f"unknown env id {env_id!r}.{did_you_mean(env_id, gym.registry)}")
    spec = gym.registry[resolved]
    try:
        creator = spec.entry_point
        if isinstance(creator, str):
            creator = gym.envs.registration.load_env_creator(creator)
        if isinstance(creator, type) and issubclass(creator, MultiAgentTextEnv):
            return creator(**{**spec.kwargs, **kwargs})  # not a gymnasium.Env: no single-agent wrappers
        return gym.make(spec, disable_env_checker=True, **kwargs)
    except (TypeError, ValueError) as e:
        raise ArealAgentsError(f"cannot make env {env_id!r} with kwargs {kwargs}: {e}") from None


# reST inline markup: :role:`text` (also ~dotted.Name, label <target>), ``literal``, `interpreted`, **strong**,
# *emphasis*; markup neither follows nor precedes a letter, a digit, ` or * (so 2*3*4 and x**2 stay).
_REST_INLINE = re.compile(
    r"(?<![\w`*])(?::[\w.+-]+:`(?P<role>[^`]+)`|``(?P<literal>[^`]+)``|`(?P<ref>[^`]+)`_{0,2}"
    r"|\*\*(?P<strong>\S(?:[^*]*\S)?)\*\*|\*(?P<em>\S(?:[^*]*\S)?)\*)(?![\w`*])"
)


def _unmarked(match: re.Match[str]) -> str:
    text = next(group for group in match.groups() if group is not None)
    if match["role"] is not None or match["ref"] is not None:
        text = re.sub(r"\s*<[^<>]+>$", "", text) or text  # `label <target>` shows its label
        if text.startswith("~"):  # :class:`~pkg.mod.Name` shows Name
            text = text[1:].rsplit(".", 1)[-1]
    return text


def plain_text(text: str) -> str:
    """``text`` without reST inline markup, for a terminal or a JSON listing: ``a op b =``, :class:`Env`,
    *word* become a op b =, Env, word."""
    return _REST_INLINE.sub(_unmarked, text)


def describe_envs(include_gymnasium: bool = False) -> list[tuple[str, str]]:
    """``(id, first docstring line of its class, as plain text)`` for registered ids, without gymnasium's own
    (CartPole, ...) unless ``include_gymnasium``."""
    out = []
    for env_id, spec in sorted(gym.registry.items()):
        entry = spec.entry_point
        module = entry.split(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")
        if not include_gymnasium and module.startswith(("gymnasium.", "shimmy", "ale_py")):
            continue
        description = ""
        try:
            creator = spec.entry_point
            if isinstance(creator, str):
                creator = gym.envs.registration.load_env_creator(creator)
            description = plain_text(((creator.__doc__ or "").strip().splitlines() or [""])[0])
        except Exception:  # an unimportable user env still gets listed
            description = "(entry point cannot be imported)"
        out.append((env_id, description))
    return out
