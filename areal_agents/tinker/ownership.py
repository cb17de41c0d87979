"""Sessions, the ids the SDK expects, checkpoint paths under the operator's root and the base models served.

Ids: a session ``sess-<hex>``; its training models ``{session}:train:{model_seq_id}`` (the SDK builds this
id itself when it creates a model by loading a checkpoint); its samplers ``{session}:sample:{seq}``.
Checkpoints: ``tinker://{model id}/weights/{name}`` (adapter and optimizer) and
``tinker://{model id}/sampler_weights/{name}`` (adapter), the directory ``root/{model id}/{kind}/{name}``.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from areal_agents.errors import ArealAgentsError, RequestError, did_you_mean
from areal_agents.models.tiny import FAMILY_CHOICES

CheckpointKind = Literal["weights", "sampler_weights"]
KINDS: tuple[CheckpointKind, ...] = ("weights", "sampler_weights")
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
MODEL_ID_RE = re.compile(r"(sess-[0-9a-f]{16}):train:(\d{1,9})")
SAMPLER_ID_RE = re.compile(r"(sess-[0-9a-f]{16}):sample:(\d{1,12})")
TINY_PREFIX = "tiny-"  # tiny-qwen3, tiny-char, ...: a tiny model of that family, built by the server


class NotFound(ArealAgentsError):
    """A session, model, sampler, request or checkpoint that does not exist (the server answers 404)."""


class SessionFinished(NotFound):
    """A session that was finished; its heartbeat gets 410, which stops the SDK's heartbeat loop."""


@dataclass(frozen=True)
class BaseModelSpec:
    """A base model clients may name: a local checkpoint directory, or a tiny model of ``family``."""

    name: str
    path: Path | None = None
    family: str | None = None


class BaseModels:
    """The base models the operator serves, by name; ``tiny-<family>`` names are allowed when ``allow_tiny``.

    Example:
        BaseModels({"my-qwen": Path("/ckpt/qwen")}).get("tiny-qwen3")  # BaseModelSpec("tiny-qwen3", family="qwen3")
    """

    def __init__(self, checkpoints: Mapping[str, Path] | None = None, allow_tiny: bool = True):
        self._specs = {name: BaseModelSpec(name, path=Path(path)) for name, path in (checkpoints or {}).items()}
        if allow_tiny:
            for family in FAMILY_CHOICES:
                self._specs.setdefault(TINY_PREFIX + family, BaseModelSpec(TINY_PREFIX + family, family=family))

    def names(self) -> list[str]:
        """Every name a client may pass as ``base_model``."""
        return list(self._specs)

    def get(self, name: str) -> BaseModelSpec:
        """The spec of ``name``; `RequestError` (400) naming the choices when it is not served."""
        if name not in self._specs:
            choices = ", ".join(self._specs) or "none"
            raise RequestError(f"base_model: expects one of {choices}, got {name!r}.{did_you_mean(name, self._specs)}")
        return self._specs[name]


@dataclass
class Session:
    """One ServiceClient's session: its models and samplers, and when it last sent a heartbeat."""

    session_id: str
    tags: list[str]
    user_metadata: dict[str, Any]
    last_heartbeat: float
    models: dict[int, str] = field(default_factory=dict)
    samplers: dict[int, str] = field(default_factory=dict)
    finished: bool = False


class SessionBook:
    """The sessions of this server, and which one owns each model and sampler id."""

    def __init__(self, max_sessions: int = 1000, clock: Callable[[], float] = time.monotonic):
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def create(self, tags: list[str], user_metadata: dict[str, Any] | None) -> Session:
        """A new session; `RequestError` when ``max_sessions`` are open (finish one first)."""
        open_ = sum(not s.finished for s in self._sessions.values())
        if open_ >= self.max_sessions:
            raise RequestError(f"create_session: {open_} sessions are open, the most this server holds; close one")
        session = Session(f"sess-{secrets.token_hex(8)}", list(tags), dict(user_metadata or {}), self._clock())
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The open session ``session_id``: `NotFound` if unknown, `SessionFinished` if finished."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"session_id: no session {session_id!r} on this server")
        if session.finished:
            raise SessionFinished(f"session_id: session {session_id!r} was finished")
        return session

    def heartbeat(self, session_id: str) -> None:
        """Record that the client is alive."""
        self.get(session_id).last_heartbeat = self._clock()

    def finish(self, session_id: str) -> Session:
        """Mark the session finished (again is fine) and return it, so the caller frees its models and futures."""
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"session_id: no session {session_id!r} on this server")
        session.finished = True
        return session

    def new_model_id(self, session_id: str, model_seq_id: int) -> str:
        """Register ``{session}:train:{model_seq_id}``; `RequestError` when that seq id is taken or negative."""
        return self._register(session_id, "models", "train", "model_seq_id", model_seq_id, 10**9)

    def new_sampler_id(self, session_id: str, seq: int) -> str:
        """Register ``{session}:sample:{seq}``; `RequestError` when that seq id is taken or negative."""
        return self._register(session_id, "samplers", "sample", "sampling_session_seq_id", seq, 10**12)

    def _register(self, session_id: str, table: str, kind: str, field: str, seq: int, limit: int) -> str:
        """``{session}:{kind}:{seq}`` entered in the session's ``table``, once per seq id."""
        taken = getattr(self.get(session_id), table)
        if not 0 <= seq < limit:
            raise RequestError(f"{field}: expects 0 <= id < {limit:.0e}, got {seq}")
        if seq in taken:
            raise RequestError(f"{field}: {table[:-1]} {taken[seq]!r} already exists")
        taken[seq] = new_id = f"{session_id}:{kind}:{seq}"
        return new_id

    def session_of_model(self, model_id: str) -> Session:
        """The open session that owns training model ``model_id``; `NotFound` otherwise."""
        return self._owner(model_id, MODEL_ID_RE, "models", "model_id: no model")

    def session_of_sampler(self, sampler_id: str) -> Session:
        """The open session that owns sampler ``sampler_id``; `NotFound` otherwise."""
        return self._owner(sampler_id, SAMPLER_ID_RE, "samplers", "sampling_session_id: no sampler")

    def _owner(self, ident: str, pattern: re.Pattern, book: str, what: str) -> Session:
        match = pattern.fullmatch(ident)
        session = self._sessions.get(match.group(1)) if match else None
        if session is None or getattr(session, book).get(int(match.group(2))) != ident:
            raise NotFound(f"{what} {ident!r} on this server")
        return self.get(session.session_id)


@dataclass(frozen=True)
class CheckpointRef:
    """A parsed ``tinker://{run}/{kind}/{name}`` and the directory it names under the root."""

    run_id: str
    kind: CheckpointKind
    name: str
    path: Path

    @property
    def uri(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


class CheckpointPaths:
    """``tinker://`` paths <-> directories under ``root``; names are checked so no path leaves the root."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    def for_save(self, model_id: str, kind: CheckpointKind, name: str, field_name: str = "path") -> CheckpointRef:
        """Where a save of ``model_id`` named ``name`` goes; `RequestError` for a bad name."""
        return self._ref(model_id, kind, _checked_name(name, field_name), field_name)

    def parse(self, uri: str, kinds: tuple[CheckpointKind, ...] = KINDS, field_name: str = "path") -> CheckpointRef:
        """The checkpoint a client's ``tinker://`` path names; `RequestError` when malformed or of another kind."""
        parts = uri.removeprefix("tinker://").split("/") if uri.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS:
            raise RequestError(f"{field_name}: expects tinker://<run>/{'|'.join(KINDS)}/<name>, got {uri!r}")
        run_id, kind, name = parts
        if kind not in kinds:
            raise RequestError(f"{field_name}: expects a {' or '.join(kinds)} checkpoint, got {uri!r}")
        if not MODEL_ID_RE.fullmatch(run_id):
            raise RequestError(f"{field_name}: expects a run id <session>:train:<n>, got {run_id!r} in {uri!r}")
        return self._ref(run_id, kind, _checked_name(name, field_name), field_name)

    def existing(self, uri: str, kinds: tuple[CheckpointKind, ...] = KINDS, field_name: str = "path") -> CheckpointRef:
        """`parse`, and `NotFound` unless that checkpoint was saved."""
        ref = self.parse(uri, kinds, field_name)
        if not ref.path.is_dir():
            raise NotFound(f"{field_name}: no checkpoint {uri!r} on this server")
        return ref

    def _ref(self, run_id: str, kind: CheckpointKind, name: str, field_name: str) -> CheckpointRef:
        if not MODEL_ID_RE.fullmatch(run_id):
            raise RequestError(f"{field_name}: expects a model id <session>:train:<n>, got {run_id!r}")
        path = self.root / run_id / kind / name
        if not path.resolve().is_relative_to(self.root):  # a symlink planted under the root
            raise RequestError(f"{field_name}: {run_id}/{kind}/{name} resolves outside the checkpoint root")
        return CheckpointRef(run_id, kind, name, path)


def _checked_name(name: str, field_name: str) -> str:
    """A checkpoint name: 1-128 of [A-Za-z0-9._-], not '.' or '..'."""
    if not NAME_RE.fullmatch(name) or name in {".", ".."}:
        raise RequestError(f"{field_name}: expects a name of 1-128 [A-Za-z0-9._-] (not '.' or '..'), got {name!r}")
    return name
