"""`LocalEnvPool`: async envs from sync gymnasium envs, run inline, in threads or in worker processes.

- ``inline``: calls run on the event loop (cheapest; only for envs that never block).
- ``thread``: calls run in a thread pool with a per-call timeout (a hung call ends its episode with a
  ``timeout`` error; the thread itself cannot be killed and finishes in the background).
- ``process``: the env's state is pickled and each call runs in any worker process of a `WorkerPool`,
  so a call that hangs is killed and a worker that dies fails only that episode. The env must be
  picklable; its state travels with every call. Workers never import the caller's ``__main__``, so the env
  must be defined in a module (one registered from ``__main__`` is refused with `WorkerImportError`).

    pool = LocalEnvPool(mode="thread", workers=4, step_timeout=30)
    env = pool.make("areal_agents/Arithmetic-v0", digits=2)
    obs, info = await env.areset(seed=0)

A `MultiAgentTextEnv` works the same with dicts keyed by agent id; its session's ``acting`` (who acts next,
`MultiAgentTextEnv.acting_agents`) and ``agents`` are set after every reset and step, in every mode.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import importlib
import pickle
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Literal

import gymnasium as gym

from areal_agents.envs.multi_agent import MultiAgentTextEnv
from areal_agents.envs.registry import import_env_module, make_env, register_builtin_envs
from areal_agents.errors import ArealAgentsError, EnvError
from areal_agents.timeline import timeline
from areal_agents.workers import CallTimeout, RemoteError, WorkerDied, WorkerImportError, WorkerPool

PoolMode = Literal["inline", "thread", "process"]


def _import_envs() -> None:
    """Worker start-up: every built-in id, before the first call's clock starts."""
    register_builtin_envs()


def _env_thread_start(threads: int) -> None:
    """A thread-mode env thread's torch intra-op threads (a thread that never sets them takes the count
    another thread of the process set last, e.g. the trainer's)."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def _worker_make(modules: tuple[str, ...], env_id: str, kwargs: dict) -> gym.Env:
    register_builtin_envs()
    for m in modules:
        importlib.import_module(m)
    return make_env(env_id, **kwargs)


def turn_order(env: Any) -> tuple[list[str], list[str]] | None:
    """``(agents, acting)`` of a multi-agent env after a reset or step (None for a single-agent env)."""
    if not isinstance(env, MultiAgentTextEnv):
        return None
    return [str(a) for a in env.possible_agents], [str(a) for a in env.acting_agents()]


def _process_reset(state: bytes | None, spec: tuple, seed: int | None, options: dict | None) -> tuple:
    env = pickle.loads(state) if state is not None else _worker_make(*spec)
    result = env.reset(seed=seed, options=options)
    return pickle.dumps(env), result, turn_order(env)


def _process_step(state: bytes, action: Any) -> tuple:
    env = pickle.loads(state)
    result = env.step(action)
    return pickle.dumps(env), result, turn_order(env)


MAX_IDLE_ENVS = 1024


def _idle_key(env_id: str, kwargs: dict[str, Any]) -> tuple[str, str]:
    """Envs made with equal id and kwargs are interchangeable after a reset (kwargs may be unhashable)."""
    return env_id, repr(sorted(kwargs.items()))


class PooledEnv:
    """One env session of a `LocalEnvPool`; implements the `AsyncEnv` interface.

    ``multi_agent``: the env is a `MultiAgentTextEnv` (dict actions and results); then ``agents`` (its
    possible agents) and ``acting`` (who acts next; [] once the episode is over) follow every reset and step.
    """

    def __init__(self, pool: LocalEnvPool, env_id: str, kwargs: dict[str, Any], agents: list[str] | None) -> None:
        self.pool, self.env_id, self.kwargs = pool, env_id, kwargs
        self.multi_agent = agents is not None
        self.agents: list[str] = agents or []
        self.acting: list[str] | None = None
        self.env: gym.Env | MultiAgentTextEnv | None = None
        self._state: bytes | None = None  # process mode: the pickled env between calls
        self._broken = False  # a call raised: the env is closed, not reused
        if pool.mode != "process":
            self.env = pool._take(env_id, kwargs) or make_env(env_id, **kwargs)
            self.multi_agent = isinstance(self.env, MultiAgentTextEnv)
            self.agents = [str(a) for a in self.env.possible_agents] if self.multi_agent else []

    def _follow(self, order: tuple[list[str], list[str]] | None) -> None:
        if order is not None:
            self.agents, self.acting = order

    async def _run(self, name: str, fn: Any, *args: Any) -> Any:
        try:
            return await self._call(name, fn, *args)
        except BaseException:
            self._broken = True  # in an unknown state: closed at the end, not reused
            raise

    async def _call(self, name: str, fn: Any, *args: Any) -> Any:
        pool = self.pool
        with pool.working(), timeline().span("episodes", f"env_{name}", env=self.env_id):
            return await self._call_worker(name, fn, *args)

    async def _call_worker(self, name: str, fn: Any, *args: Any) -> Any:
        pool = self.pool
        try:
            if pool.mode == "inline":
                return fn(*args)
            if pool.mode == "thread":
                async with asyncio.timeout(pool.step_timeout):
                    context = contextvars.copy_context()  # e.g. a server's `only_modules` reaches the thread
                    return await asyncio.get_running_loop().run_in_executor(pool.threads, context.run, fn, *args)
            return await pool.workers.call(fn, *args, timeout=pool.step_timeout)
        except (TimeoutError, CallTimeout):
            raise EnvError("timeout", f"{self.env_id} {name} exceeded {pool.step_timeout}s") from None
        except WorkerDied as e:
            raise EnvError("worker_died", f"{self.env_id} {name}: {e}") from None
        except RemoteError as e:
            raise EnvError("env_error", f"{self.env_id} {name} raised {e}") from e  # the cause names the type
        except ArealAgentsError:
            raise
        except Exception as e:
            raise EnvError("env_error", f"{self.env_id} {name} raised {type(e).__name__}: {e}") from e

    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        if self.pool.mode != "process":
            env = self.env
            result, order = await self._run("reset", lambda: (env.reset(seed=seed, options=options), turn_order(env)))
        else:
            spec = (self.pool.modules, self.env_id, self.kwargs)
            self._state, result, order = await self._run("reset", _process_reset, self._state, spec, seed, options)
        self._follow(order)
        return result

    async def astep(self, action: Any) -> tuple[Any, Any, Any, Any, Any]:
        """One step: a text action, or (multi-agent) a dict of one action per acting agent."""
        if self.pool.mode != "process":
            env = self.env
            result, order = await self._run("step", lambda: (env.step(action), turn_order(env)))
        else:
            if self._state is None:
                raise EnvError("env_error", f"{self.env_id}: step() before reset()")
            self._state, result, order = await self._run("step", _process_step, self._state, action)
        self._follow(order)
        return result

    async def aclose(self) -> None:
        if self.env is not None:
            if self._broken or not self.pool._give_back(self.env_id, self.kwargs, self.env):
                self.env.close()
            self.env = None
        self._state = None


class LocalEnvPool:
    """Make `PooledEnv` sessions sharing one thread pool or one `WorkerPool`; each of its ``workers`` threads or
    processes computes with ``worker_threads`` intra-op threads (an env is Python; N teams of every core beside
    the engine's and the trainer's would oversubscribe them)."""

    def __init__(
        self,
        mode: PoolMode = "thread",
        workers: int = 4,
        step_timeout: float | None = 60.0,
        modules: tuple[str, ...] | list[str] = (),
        worker_threads: int = 1,
    ) -> None:
        if mode not in ("inline", "thread", "process"):
            raise ValueError(f"Expects mode 'inline', 'thread' or 'process', got {mode!r}")
        self.mode: PoolMode = mode
        self.step_timeout = step_timeout
        self.modules = tuple(m for m in modules if m)
        for m in self.modules:
            import_env_module(m)
        self.threads = None
        if mode == "thread":
            self.threads = ThreadPoolExecutor(workers, "env", initializer=_env_thread_start, initargs=(worker_threads,))
        self.workers = None
        if mode == "process":  # one intra-op thread each: N workers beside the engine and the trainer
            self.workers = WorkerPool(workers, initializer=_import_envs, name="env-pool", threads=worker_threads)
        self._idle: dict[tuple[str, str], list[Any]] = {}  # closed sessions' envs, reused by the next make
        self._free = list(range(1 if mode == "inline" else workers))  # worker slots: a timeline row each
        self.in_flight = 0  # resets and steps running
        tl = timeline()
        for slot in self._free:
            tl.idle(f"env/pool/{slot}")
        tl.gauge("env/steps_in_flight", lambda: self.in_flight)

    @contextmanager
    def working(self) -> Iterator[None]:
        """A reset or step runs: busy on the lowest free worker slot (the timeline's row), counted in flight."""
        slot = heapq.heappop(self._free) if self._free else None
        self.in_flight += 1
        tl = timeline()
        if slot is not None:
            tl.enter(f"env/pool/{slot}")
        try:
            yield
        finally:
            self.in_flight -= 1
            if slot is not None:
                tl.leave(f"env/pool/{slot}")
                heapq.heappush(self._free, slot)

    def _take(self, env_id: str, kwargs: dict[str, Any]) -> Any:
        """An idle env made with the same id and kwargs (``reset`` starts it afresh), or None.

        Making an env per episode (gymnasium's registry, wrappers, spaces) cost more than the episode's
        own steps for small text envs, so sessions that ended cleanly hand theirs back."""
        idle = self._idle.get(_idle_key(env_id, kwargs))
        return idle.pop() if idle else None

    def _give_back(self, env_id: str, kwargs: dict[str, Any], env: Any) -> bool:
        idle = self._idle.setdefault(_idle_key(env_id, kwargs), [])
        if len(idle) >= MAX_IDLE_ENVS:
            return False
        idle.append(env)
        return True

    def make(self, env_id: str, **kwargs: Any) -> PooledEnv:
        """A new env session; unknown ids and bad kwargs fail here, before any episode starts."""
        agents = None
        if self.mode == "process":
            env = make_env(env_id, **kwargs)  # validate here; workers import the env's module
            agents = [str(a) for a in env.possible_agents] if isinstance(env, MultiAgentTextEnv) else None
            spec = getattr(env, "spec", None)  # a MultiAgentTextEnv has none: its class names the module
            entry = spec.entry_point if spec is not None else type(env)
            module = entry.split(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")
            env.close()
            if module == "__main__":
                name = entry.split(":")[-1] if isinstance(entry, str) else entry.__qualname__
                raise WorkerImportError(
                    f"{env_id}: its class {name} is defined in __main__, which process-mode workers never import: "
                    "define and register it in a module (or use mode 'thread')"
                )
            if module and module not in self.modules:
                self.modules = (*self.modules, module)
        return PooledEnv(self, env_id, kwargs, agents)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for env in idle:
                env.close()
        self._idle.clear()
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()
