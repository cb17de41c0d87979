"""The gateway's API keys (one per client, from the operator's file) and their per-minute request and token limits.

    # keys.yaml
    sk-app-1: {name: support-bot, requests_per_minute: 600, tokens_per_minute: 200000}
    sk-app-2: {name: ci-agent}          # no limits

A key comes as ``Authorization: Bearer KEY`` (OpenAI's SDKs) or ``x-api-key: KEY`` (Anthropic's).
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from areal_agents.errors import ConfigError
from areal_agents.rollout.gateway.session_book import SessionError

_WINDOW_S = 60.0


@dataclass(frozen=True)
class KeyPolicy:
    name: str
    requests_per_minute: int = 0  # 0 = no limit
    tokens_per_minute: int = 0  # prompt + generated tokens; 0 = no limit


class ApiKeys:
    """The keys the operator allowed; with none, every client is the anonymous key ``""`` (loopback only)."""

    def __init__(self, keys: dict[str, KeyPolicy]) -> None:
        self.keys = keys

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        """The keys of ``path`` (YAML or JSON); none when ``path`` is empty. A bad entry is a `ConfigError`."""
        if not path:
            return cls({})
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"gateway.api_keys_file {path}: cannot read it: {e}") from e
        if not isinstance(loaded, dict) or not loaded:
            raise ConfigError(f"gateway.api_keys_file {path}: expects a mapping of API key -> {{name, limits}}")
        return cls({str(key): _policy(path, str(key), entry) for key, entry in loaded.items()})

    def identify(self, authorization: str | None, x_api_key: str | None) -> KeyPolicy:
        """The policy of the key a request carries; 401 without a known one (when keys are configured)."""
        if not self.keys:
            return KeyPolicy("")
        scheme, _, token = (authorization or "").partition(" ")
        given = (x_api_key or (token.strip() if scheme.lower() == "bearer" else "")).encode()
        for key, policy in self.keys.items():
            if given and secrets.compare_digest(given, key.encode()):
                return policy
        raise SessionError(401, "an API key from gateway.api_keys_file is needed (Authorization: Bearer, or x-api-key)")


def _policy(path: str, key: str, entry: object) -> KeyPolicy:
    where = f"gateway.api_keys_file {path}: key {key[:4]}...'s"
    entry = {} if entry is None else entry
    if len(key) < 16:
        raise ConfigError(f"{where} value: a key needs at least 16 characters")
    if not isinstance(entry, dict) or set(entry) - {"name", "requests_per_minute", "tokens_per_minute"}:
        raise ConfigError(f"{where} entry: expects {{name, requests_per_minute, tokens_per_minute}}, got {entry!r}")
    for field in ("requests_per_minute", "tokens_per_minute"):
        value = entry.get(field, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where} {field}: expects an integer >= 0, got {value!r}")
    return KeyPolicy(str(entry.get("name") or key[:4] + "..."), entry.get("requests_per_minute", 0),
                     entry.get("tokens_per_minute", 0))  # fmt: skip


class RateLimits:
    """Each key's requests and tokens over the last minute; `admit` refuses (429) a request over either limit."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._requests: dict[str, deque[float]] = {}
        self._tokens: dict[str, deque[tuple[float, int]]] = {}

    def admit(self, policy: KeyPolicy) -> None:
        now = self.clock()
        requests = _recent(self._requests.setdefault(policy.name, deque()), now, lambda x: x)
        tokens = _recent(self._tokens.setdefault(policy.name, deque()), now, lambda x: x[0])
        if policy.requests_per_minute and len(requests) >= policy.requests_per_minute:
            raise SessionError(429, f"key {policy.name!r}: {policy.requests_per_minute} requests a minute at most")
        if policy.tokens_per_minute and sum(n for _, n in tokens) >= policy.tokens_per_minute:
            raise SessionError(429, f"key {policy.name!r}: {policy.tokens_per_minute} tokens a minute at most")
        requests.append(now)

    def spent(self, policy: KeyPolicy, tokens: int) -> None:
        """Count a served call's prompt and generated tokens against its key."""
        if policy.tokens_per_minute:
            self._tokens.setdefault(policy.name, deque()).append((self.clock(), tokens))


def _recent(window: deque, now: float, at: Callable) -> deque:
    while window and now - at(window[0]) >= _WINDOW_S:
        window.popleft()
    return window
