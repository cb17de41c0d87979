"""`make_agent`: the agent a config names (``rollout.agent``), built with the run's engine and tokenizer."""

from __future__ import annotations

import inspect
from typing import Any

from transformers import PreTrainedTokenizerBase

from areal_agents.agents.base import Agent
from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.agents.episode_function import EpisodeFunctionAgent
from areal_agents.config import RolloutConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.errors import ConfigError
from areal_agents.importing import load_object
from areal_agents.types import SamplingParams


def make_rollout_agent(
    r: RolloutConfig,
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams | None = None,
) -> Agent:
    """The agent ``rollout.*`` configures, sampling as the rollout does unless ``sampling`` is given."""
    sampling = sampling or SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k)
    chat = {
        "tool_parser": r.tool_parser,
        "reasoning_parser": r.reasoning_parser,
        "chat_template_kwargs": r.chat_template_kwargs,
        "keep_reasoning": r.keep_reasoning,
    }
    return make_agent(
        r.agent, engine, tokenizer, sampling, system_prompt=r.system_prompt, kwargs=r.agent_kwargs, chat=chat
    )


def make_agent(
    spec: str,
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams,
    *,
    system_prompt: str = "",
    kwargs: dict[str, Any] | None = None,
    chat: dict[str, Any] | None = None,
) -> Agent:
    """``spec``: empty (a `ChatAgent`), ``module:Class`` (built as ``Class(engine, tokenizer, sampling,
    **kwargs)``, with ``system_prompt`` when it takes one) or ``module:function`` (an async episode function).
    ``chat``: how replies are parsed and rendered (``tool_parser``, ...), given to agents that take them."""
    kwargs = dict(kwargs or {})
    target: Any = ChatAgent if not spec else load_object(spec, "rollout.agent")
    if inspect.iscoroutinefunction(target):
        if _takes(EpisodeFunctionAgent, "tool_parser"):
            kwargs = {**(chat or {}), **kwargs}
        return EpisodeFunctionAgent(target, engine, tokenizer, sampling, **kwargs)
    if not inspect.isclass(target):
        raise ConfigError(
            f"rollout.agent {spec!r}: expects an agent class or an `async def run(client, task)` function, "
            f"got {type(target).__name__}"
        )
    if "system_prompt" in inspect.signature(target).parameters or issubclass(target, ChatAgent):
        kwargs.setdefault("system_prompt", system_prompt)
    if issubclass(target, ChatAgent) or _takes(target, "tool_parser"):
        kwargs = {**(chat or {}), **kwargs}
    try:
        inspect.signature(target).bind(engine, tokenizer, sampling, **kwargs)
    except TypeError as e:
        raise ConfigError(f"rollout.agent {spec!r}: cannot build it with rollout.agent_kwargs {kwargs}: {e}") from e
    if not callable(inspect.getattr_static(target, "run_episode", None)):
        raise ConfigError(f"rollout.agent {spec!r}: an agent needs `async def run_episode(env, *, seed, episode_id)`")
    return _as_agent(target)(engine, tokenizer, sampling, **kwargs)


def _as_agent(cls: type) -> type[Agent]:
    """``cls``, or for a class that does not derive from `Agent` (one with ``run_episode`` alone), a subclass
    with `Agent` behind it, so every agent has the protocol's members (its own ``aclose`` first)."""
    if Agent in cls.__mro__:
        return cls
    return type(cls.__name__, (cls, Agent), {"__module__": cls.__module__, "__doc__": cls.__doc__})


def _takes(cls: Any, name: str) -> bool:
    """Whether ``cls(...)`` accepts the keyword ``name``."""
    return name in inspect.signature(cls).parameters
