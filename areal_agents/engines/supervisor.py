"""The model servers a run launched (`ServerGroup`: addresses, processes, logs; ``stop()``), and keeping them
up: `Supervisor` restarts one whose process ended, whose /health
answers 503 (serve-model: its decode loop failed or is stuck) or that stops answering, on the same
address, serving the run's current weights under their weight_version before it takes requests again.
A server whose /health says it is paused (serve-model's 503 with ``"status": "paused"``: a trainer's weight
update, or a client's /pause_generation) is alive and left alone; one paused longer than ``paused_warn_s``
is reported once (`paused` holds since when each is paused).

The run's current weights are the newest complete ``engine_weights/vN`` written since the launch (what
`SGLangEngine.update_weights` pushes), or else what the servers last reported (/get_model_info: the
path they loaded and the weight_version, which a resumed run announces), or else the launch's
checkpoint. A restarted server starts from a directory of links: the checkpoint's config and tokenizer
files with those weights; once healthy, it is brought up to any newer version pushed meanwhile.

    group = launch_servers(cfg, "runs/x/model", log_dir=..., weights_dir="runs/x/engine_weights")
    group.supervisor.restarts        # [Restart(index, reason, weights, version, ...)], one per restart
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from areal_agents.engines.server_control import admin_headers, admin_key_from_env, health_state
from areal_agents.net import wait_healthy
from areal_agents.workers import die_with_parent

# (index, model path, tokenizer path, weight_version) -> the server's command line
CommandFor = Callable[[int, str, str, "str | None"], list[str]]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".safetensors.index.json")


class Servers(Protocol):
    """The model servers behind a policy's engine, as its run holds them: where they listen, who restarts them."""

    addresses: list[str]
    supervisor: Supervisor | None  # restarts the servers from this process (None: none does, or each its own)
    admin_key: str | None  # what their control routes want (None: AREAL_ADMIN_KEY, if any)

    def stop(self) -> None: ...


@dataclass
class ServerGroup:
    """Model servers: their addresses and, for those this process started, the processes and logs."""

    addresses: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    supervisor: Supervisor | None = None  # a `Supervisor` restarting the servers this process started (stopped first)
    scratch: list[Path] = field(default_factory=list)  # the servers' own temporary files, deleted at stop
    admin_key: str | None = None  # the key the servers this process started want on their control routes

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class Served:
    """Weights a server serves: the directory of their ``*.safetensors`` and their weight_version name."""

    path: str
    version: str | None = None  # None: the server's default ("default")

    @property
    def rank(self) -> int:
        """The version as a number (the run's int versions; -1 for "default" or another name)."""
        return int(self.version) if self.version is not None and self.version.isdigit() else -1


@dataclass
class Restart:
    """One restart: which server, why, what it serves since, and how its old process stopped."""

    index: int
    reason: str
    served: Served
    old_pid: int
    stopped_by: str  # "exited" (it had), "SIGTERM" or "SIGKILL"
    stop_seconds: float
    at: float = field(default_factory=time.time)


@dataclass
class Supervisor:
    """Watches ``group``'s servers from a thread and restarts them (see the module docstring)."""

    group: ServerGroup
    command_for: CommandFor
    model_path: str  # the launch's checkpoint: config and tokenizer, and the weights until new ones are pushed
    weights_dir: Path | None = None  # where weight updates are written (engine_weights/vN)
    spawn: Callable[[list[str], Path], subprocess.Popen] | None = None  # default: `spawn_server`
    startup_timeout_s: float = 600.0
    check_every_s: float = 2.0
    unanswered_s: float = 60.0  # a live process whose /health has not answered for this long is restarted
    failing_s: float = 0.0  # ... and one answering 503 for this long (serve-model's 503 is final; SGLang's passes)
    max_restarts: int = 3  # per server within `restart_window_s`; past that it is left down (and said so)
    restart_window_s: float = 600.0
    since: float = field(default_factory=time.time)  # weights written before this are an earlier run's
    admin_key: str | None = field(default_factory=admin_key_from_env)  # the servers' --admin-key (its catch-up load)
    paused_warn_s: float = 600.0  # a server paused this long is reported (once per pause)

    def __post_init__(self) -> None:
        self.restarts: list[Restart] = []
        self.reported = Served(self.model_path)  # what the servers last said they serve
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._answered = [time.monotonic()] * len(self.group.addresses)
        self._failing: dict[int, float] = {}  # server -> when its current run of 503s began
        self._given_up: set[int] = set()
        self.paused: dict[int, float] = {}  # server -> time.monotonic() since when its /health says paused
        self._warned: set[int] = set()

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._watch, name="server-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def current(self) -> Served:
        """The run's current weights: pushed to disk since the launch, else reported, else the checkpoint."""
        pushed = pushed_weights(self.weights_dir, self.since) if self.weights_dir else None
        if pushed is not None and pushed.rank > self.reported.rank:
            return pushed
        return self.reported

    # ---- the watch ----------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.check_every_s):
            for i in range(len(self.group.addresses)):
                if self._stop.is_set():
                    return
                if i not in self._given_up:
                    try:
                        self._check(i)
                    except Exception as e:  # noqa: BLE001  (the watch must go on)
                        _say(f"supervising {self.group.addresses[i]} failed: {type(e).__name__}: {e}")

    def _check(self, i: int) -> None:
        proc, url = self.group.procs[i], self.group.addresses[i]
        if proc.poll() is not None:
            self._restart(i, f"its process exited with code {proc.returncode}")
            return
        status, body = _get(url, "/health")
        now, state = time.monotonic(), health_state(status, body)
        if status != 503 or state == "paused":
            self._failing.pop(i, None)
        if state != "paused":
            self.paused.pop(i, None)
            self._warned.discard(i)
        if state == "ok":
            self._answered[i] = now
            self._note_reported(url)
        elif state == "paused":  # alive, generating nothing on purpose: never restarted for it
            self._answered[i] = now
            since = self.paused.setdefault(i, now)
            if now - since >= self.paused_warn_s and i not in self._warned:
                self._warned.add(i)
                _say(
                    f"model server {url} has been paused for {now - since:.0f}s (/pause_generation): nothing "
                    "generates there until /continue_generation"
                )
        elif status == 503:
            if now - self._failing.setdefault(i, now) >= self.failing_s:
                self._restart(i, f"/health answered 503: {_message(body)}")
        elif now - self._answered[i] > self.unanswered_s:
            self._restart(i, f"/health has not answered for {self.unanswered_s:.0f}s")

    def _note_reported(self, url: str) -> None:
        status, body = _get(url, "/get_model_info")
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return
        version = body.get("weight_version")
        seen = Served(body["model_path"], None if version in (None, "default") else str(version))
        if seen.rank > self.reported.rank:
            self.reported = seen

    def _restart(self, i: int, reason: str) -> None:
        recent = [r for r in self.restarts if r.index == i and time.time() - r.at < self.restart_window_s]
        url = self.group.addresses[i]
        if len(recent) >= self.max_restarts:
            self._given_up.add(i)
            _say(f"model server {url} is down ({reason}) after {len(recent)} restarts: not restarting it again")
            return
        old = self.group.procs[i]
        stopped_by, seconds = stop_process(old)
        if self._stop.is_set():  # the group is being stopped: no new process behind its back
            return
        served = self.current()
        model_dir = restart_dir(
            self.model_path, served.path, self.group.logs[i].parent / f"restart-{i}-{len(self.restarts)}"
        )
        command = self.command_for(i, model_dir, self.model_path, served.version)
        proc = (self.spawn or spawn_server)(command, self.group.logs[i])
        self.group.procs[i] = proc
        self.restarts.append(Restart(i, reason, served, old.pid, stopped_by, seconds))
        version = served.version or "default"
        _say(f"model server {url} restarted ({reason}); it serves {served.path} as weight_version {version}")
        self._failing.pop(i, None)
        if self._wait_healthy(i):
            self._answered[i] = time.monotonic()
            newer = self.current()
            if newer.rank > served.rank:  # pushed while it started: catch up before the next step
                body = {"model_path": newer.path, "weight_version": newer.version, "abort_all_requests": False}
                _post(url, "/update_weights_from_disk", body, headers=admin_headers(self.admin_key))

    def _wait_healthy(self, i: int) -> bool:
        proc = self.group.procs[i]
        return wait_healthy(
            self.group.addresses[i],
            self.startup_timeout_s,
            alive=lambda: proc.poll() is None,
            stopped=self._stop.is_set,
        )  # False: it died (the next check restarts it again), timed out, or the supervisor stopped


def spawn_server(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server in a session of its own (so its process group can be stopped), appending to ``log``
    (``env``: its environment, default this process's); it gets SIGTERM if this process dies (`die_with_parent`:
    started from the run's main thread, or the supervisor's, which stops them all when it ends)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, preexec_fn=die_with_parent
        )


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> tuple[str, float]:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``timeout_s``: (how it stopped, seconds taken)."""
    start = time.monotonic()
    if proc.poll() is not None:
        return "exited", 0.0
    for how, wait_s in (("SIGTERM", timeout_s), ("SIGKILL", None)):
        try:
            os.killpg(proc.pid, getattr(signal, how))
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            return how, time.monotonic() - start
        except subprocess.TimeoutExpired:
            continue
    return "SIGKILL", time.monotonic() - start


def pushed_weights(weights_dir: Path, since: float) -> Served | None:
    """The newest ``weights_dir/vN`` whose ``*.safetensors`` were all written completely since ``since``."""
    best: tuple[int, Path] | None = None
    for d in Path(weights_dir).glob("v*"):
        if not (d.name[1:].isdigit() and d.is_dir()) or (best is not None and int(d.name[1:]) <= best[0]):
            continue
        files = list(d.glob("*.safetensors"))
        if files and all(f.stat().st_mtime >= since and complete_safetensors(f) for f in files):
            best = (int(d.name[1:]), d)
    return None if best is None else Served(str(best[1]), str(best[0]))


def complete_safetensors(path: Path) -> bool:
    """Whether ``path`` holds a whole safetensors file (its header's tensors all end inside it)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 1 << 30:
                return False
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        return path.stat().st_size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def restart_dir(model_path: str, weights_path: str, dest: Path) -> str:
    """A model directory for a restart: ``weights_path`` if it is one (or the checkpoint itself), else
    ``dest`` with links to the checkpoint's config and tokenizer files and to the weights' files."""
    weights = Path(weights_path).resolve()
    if weights == Path(model_path).resolve() or (weights / "config.json").exists():
        return str(weights)
    dest.mkdir(parents=True, exist_ok=True)
    for f in Path(model_path).resolve().iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            _link(f, dest / f.name)
    for f in weights.iterdir():
        if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES):
            _link(f.resolve(), dest / f.name)
    return str(dest)


def _link(target: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def _get(url: str, path: str, timeout_s: float = 5.0) -> tuple[int | None, Any]:
    """(status, JSON body or text) of GET ``url + path``; status None if it did not answer."""
    return _call(urllib.request.Request(url + path), timeout_s)


def _post(
    url: str, path: str, body: dict, timeout_s: float = 600.0, headers: dict[str, str] | None = None
) -> tuple[int | None, Any]:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url + path, data=data, headers=headers)
    return _call(request, timeout_s)


def _call(request: urllib.request.Request, timeout_s: float) -> tuple[int | None, Any]:
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None, None
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return str(body or "")[:300]


def _say(line: str) -> None:
    print(f"engine: {line}", file=sys.stderr, flush=True)
