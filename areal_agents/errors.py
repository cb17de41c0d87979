"""The exception hierarchy. The CLI turns any `ArealAgentsError` into one line and exit code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ArealAgentsError(Exception):
    """A user-facing error: the message names the thing, what was expected and what was got."""


class ConfigError(ArealAgentsError):
    """A config file or override is missing, malformed, has an unknown key or a wrong type."""


class UnknownEnvError(ArealAgentsError):
    """An env id that is not registered with gymnasium."""


class ModelLoadError(ArealAgentsError):
    """A model or tokenizer path that does not exist or cannot be loaded."""


class EngineError(ArealAgentsError):
    """An inference engine failed to serve a request."""


class RequestError(EngineError, ValueError):
    """A request the engine refuses, with the field named (serve-model answers 400). Sending it again gets
    the same answer: the episode runner never retries it, whichever engine refused it."""


class TinkerUserError(RequestError):
    """A Tinker request the client got wrong (a field, a shape, a token, a loss): the message names the field;
    serve-tinker answers 400 or fails the request's future with category ``user`` (as any `RequestError`)."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ' Did you mean X?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


class EnvError(ArealAgentsError):
    """An env failed during an episode; the episode ends and counts as an env failure, not a policy one.

    ``kind`` is ``env_error`` (the env raised), ``timeout`` (a call overran its limit), ``worker_died``
    (the process running the env died), or, for an env-step server, ``unreachable`` (no answer),
    ``server_error`` (a 5xx), ``server_lost`` / ``session_lost`` (the session went with its server or expired).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.detail = message


class WorkerLostError(ArealAgentsError):
    """The rollout worker running an episode died (a cluster fault): the episode is retried elsewhere."""


class RunHalted(ArealAgentsError):
    """The run cannot make progress: its episodes keep failing, an env server refuses its requests or stays
    unreachable, or its cluster is gone. The run stops, keeping its last finished step, with this one line."""


class ClusterError(RunHalted):
    """The cluster cannot carry on (actors died and did not come back): the run stops with the reason."""
