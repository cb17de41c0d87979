"""Gateway sessions: a client's calls captured in one `ChatCapture`, ended, rewarded (maybe hours later), then
handed on as trajectories; or dropped, counted, when no reward comes within ``gateway.reward_timeout_s``.

A session is ready when it has ended and has its reward: one for the session, or one for every call. Its
trajectories then carry the running baseline of its task (``metadata["baseline"]``, ppo.advantage=baseline)
and are grouped by the client's task key (group advantages compare sessions of one task in a batch).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_agents.agents.capture import ChatCapture
from areal_agents.config.gateway_section import GatewayConfig
from areal_agents.types import Trajectory

SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
TASK_KEY = re.compile(r"[^\x00-\x1f]{0,256}")
_REMEMBERED = 65536  # ids of sessions handed on or dropped, to answer 409/410 rather than 404
_REPLY_IDS = ("resp_", "msg_")  # a Response's and an Anthropic Message's id: the call's "chatcmpl-" id renamed


def call_id(seen: str) -> str:
    """The capture's completion id of the call whose reply had id ``seen`` in any of the three APIs."""
    prefix = next((p for p in _REPLY_IDS if seen.startswith(p)), None)
    return "chatcmpl-" + seen.removeprefix(prefix) if prefix else seen


class SessionError(Exception):
    """What a client did wrong with a session: the HTTP status and a message naming the session or field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Session:
    id: str
    capture: ChatCapture
    task: str  # the client's task key ("" = none)
    owner: str  # the API key's name that opened it ("" without keys)
    opened: float
    last_call: float
    ended: float | None = None
    calls: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time: they extend one conversation

    def ready(self) -> bool:
        """Ended, with its reward: the session's, or one for every call it made."""
        if self.ended is None or self.calls == 0:
            return False
        capture = self.capture
        if capture.episode_reward is not None:
            return True
        calls = {c for s in capture.segments for c in s.completion_ids}
        return bool(calls) and calls <= capture.call_rewards.keys()

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "task": self.task,
            "calls": self.calls,
            "ended": self.ended is not None,
            "reward": self.capture.episode_reward,
            "call_rewards": dict(self.capture.call_rewards),
        }


@dataclass
class FinishedSession:
    """A rewarded session's trajectories, ready for training (or for the trajectory store)."""

    session_id: str
    task: str
    reward: float
    baseline: float
    trajectories: list[Trajectory]

    @property
    def oldest_version(self) -> int:
        """The policy version of its oldest generated token (-1: none)."""
        versions = [v for t in self.trajectories for v in t.versions if v >= 0]
        return min(versions, default=-1)


class RunningBaselines:
    """A running mean reward per task key: b <- d*b + (1-d)*r. A session is compared with the baseline before
    its own reward joins it; a task's first session with the all-task baseline (its first: its own reward)."""

    def __init__(self, decay: float, state: dict[str, float] | None = None) -> None:
        self.decay, self.values = decay, dict(state or {})

    def take(self, task: str, reward: float) -> float:
        """The baseline ``reward`` is compared with; then fold ``reward`` into its task's and the all-task one."""
        overall = self.values.get("", reward)
        baseline = self.values.get(task, overall)
        for key in {task, ""}:
            old = self.values.get(key, reward if key == "" else overall)
            self.values[key] = self.decay * old + (1 - self.decay) * reward
        return baseline


@dataclass
class SessionCounts:
    opened: int = 0
    handed_on: int = 0  # ended and rewarded: trajectories
    expired: int = 0  # no reward within reward_timeout_s
    idle_ended: int = 0  # ended by the gateway after session_idle_s without a call
    calls: int = 0
    unsessioned_calls: int = 0  # served, not captured


class SessionBook:
    """The gateway's sessions, by id. ``on_ready`` receives each `FinishedSession`; `sweep` ends idle sessions and
    drops unrewarded ones past their timeout."""

    def __init__(
        self,
        cfg: GatewayConfig,
        new_capture: Callable[[str], ChatCapture],
        on_ready: Callable[[FinishedSession], None],
        baselines: RunningBaselines | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.new_capture, self.on_ready, self.clock = cfg, new_capture, on_ready, clock
        self.baselines = baselines or RunningBaselines(cfg.baseline_decay)
        self.sessions: dict[str, Session] = {}
        self.counts = SessionCounts()
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> "trained" | "expired"

    def open(self, task: str = "", owner: str = "", session_id: str | None = None) -> Session:
        if not isinstance(task, str) or not TASK_KEY.fullmatch(task):
            raise SessionError(400, "task: expects a string of at most 256 printable characters")
        if session_id is not None and not SESSION_ID.fullmatch(session_id):
            raise SessionError(400, "session id: expects 1-128 characters of A-Z a-z 0-9 . _ : -")
        if len(self.sessions) >= self.cfg.max_open_sessions:
            raise SessionError(429, f"{len(self.sessions)} sessions open (gateway.max_open_sessions): end some first")
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions or sid in self._gone:
            raise SessionError(409, f"session {sid!r} exists already")
        now = self.clock()
        self.sessions[sid] = Session(sid, self.new_capture(sid), task, owner, now, now)
        self.counts.opened += 1
        return self.sessions[sid]

    def get(self, sid: str, owner: str = "") -> Session:
        session = self.sessions.get(sid)
        if session is None:
            gone = self._gone.get(sid)
            if gone == "expired":
                raise SessionError(410, f"session {sid!r} expired without a reward (gateway.reward_timeout_s)")
            if gone is not None:
                raise SessionError(409, f"session {sid!r} is rewarded and handed to training already")
            raise SessionError(404, f"unknown session {sid!r}: open it with POST /rl/sessions or an X-Session-Id")
        if session.owner != owner:
            raise SessionError(403, f"session {sid!r} belongs to another API key")
        return session

    def session_for_call(self, sid: str, owner: str, task: str = "") -> Session:
        """The session a call names, opened now (with ``task``) if new; refused once ended or at its call limit."""
        known = sid in self.sessions or sid in self._gone
        session = self.get(sid, owner) if known else self.open(task, owner, sid)
        if session.ended is not None:
            raise SessionError(409, f"session {sid!r} has ended: open a new one")
        if session.calls >= self.cfg.max_calls_per_session:
            raise SessionError(429, f"session {sid!r} made {session.calls} calls (gateway.max_calls_per_session)")
        session.calls += 1
        session.last_call = self.clock()
        self.counts.calls += 1
        return session

    def end(self, sid: str, owner: str = "") -> Session:
        session = self.get(sid, owner)
        if session.ended is None:
            session.ended = self.clock()
        self._hand_on_if_ready(session)
        return session

    def reward(self, sid: str, reward: Any, completion_id: Any = None, owner: str = "") -> Session:
        """Set the session's reward, or one call's (``completion_id``: its reply's id, ``chatcmpl-``, ``resp_`` or
        ``msg_``); each may be set once."""
        session = self.get(sid, owner)
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise SessionError(400, f"reward: expects a finite number, got {reward!r}")
        capture = session.capture
        if completion_id is None:
            if capture.episode_reward is not None:
                raise SessionError(409, f"session {sid!r} has its reward already ({capture.episode_reward})")
            capture.set_reward(float(reward))
        else:
            if not isinstance(completion_id, str):
                raise SessionError(400, "completion_id: expects the id of one of the session's calls (a string)")
            call = call_id(completion_id)
            if call in capture.call_rewards:
                raise SessionError(409, f"completion_id: call {completion_id!r} has its reward already")
            if not any(call in s.completion_ids for s in capture.segments):
                raise SessionError(404, f"completion_id: no call of session {sid!r} has id {completion_id!r}")
            capture.set_reward(float(reward), call)
        self._hand_on_if_ready(session)
        return session

    def sweep(self) -> None:
        """End sessions idle past ``session_idle_s``; drop ended ones with no reward past ``reward_timeout_s``."""
        now = self.clock()
        for session in list(self.sessions.values()):
            if session.lock.locked():
                continue  # a call is running
            if session.ended is None and now - session.last_call >= self.cfg.session_idle_s:
                session.ended = now
                self.counts.idle_ended += 1
                self._hand_on_if_ready(session)
            elif session.ended is not None and now - session.ended >= self.cfg.reward_timeout_s:
                self._forget(session.id, "expired")
                self.counts.expired += 1

    def _hand_on_if_ready(self, session: Session) -> None:
        if not session.ready() or session.lock.locked():
            return
        trajectories = session.capture.trajectories()
        self._forget(session.id, "trained")
        if not trajectories:  # no generated token (every call failed): nothing to train
            return
        reward = session.capture.reward
        baseline = self.baselines.take(session.task, reward)
        for t in trajectories:
            t.group_id = f"task:{session.task}" if session.task else session.id
            t.metadata |= {"baseline": baseline, "task": session.task, "session": session.id}
        self.counts.handed_on += 1
        self.on_ready(FinishedSession(session.id, session.task, reward, baseline, trajectories))

    def call_finished(self, session: Session) -> None:
        """A call of ``session`` returned: a session ended or rewarded while it ran may be ready now."""
        if session.id in self.sessions:
            self._hand_on_if_ready(session)

    def _forget(self, sid: str, why: str) -> None:
        self.sessions.pop(sid, None)
        self._gone[sid] = why
        while len(self._gone) > _REMEMBERED:
            self._gone.popitem(last=False)
