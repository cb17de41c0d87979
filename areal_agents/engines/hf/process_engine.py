"""`ProcessEngine`: the `HFEngine` in a child process of its own, behind a pipe (``engine.own_process``).

The in-process engine's decode thread shares the run's GIL with the event loop (agents, envs) and the
trainer, and every torch call hands the GIL over; on a small machine with rollouts overlapping updates
the decode thread spent most of its time waiting for it. A spawned process has its own interpreter.
Unlike a model server (serve-model), there is no HTTP per request: the requests submitted in one turn of
the event loop go as one pickled message, the responses finished in one turn of the child's loop come
back as one, and new weights travel as shared-memory tensors.

    engine = ProcessEngine("runs/arith/sft/model", options=EngineOptions(max_running_requests=256))
    resp = await engine.agenerate(GenRequest("r1", prompt_ids, SamplingParams(max_new_tokens=8)))
    await engine.update_weights(trainer_model.state_dict())      # pause, load, version += 1, resume
    await engine.load_lora_adapter("a1", "runs/x/adapter")      # requests with lora_name="a1" use it
    engine.close()
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import threading
import traceback
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory pickling of tensors sent as weights)

from areal_agents.config import EngineOptions
from areal_agents.engines.base import LoraEngine
from areal_agents.engines.process_malloc import keep_freed_memory
from areal_agents.errors import ArealAgentsError, ConfigError, EngineError, RequestError
from areal_agents.timeline import timeline_from_env
from areal_agents.types import GenRequest, GenResponse
from areal_agents.workers import start_child, stop_child

_START_TIMEOUT_S = 600.0


def _serve(conn: Any, model_path: str, dtype: str, options: EngineOptions, placement: dict[str, Any]) -> None:
    """The child: an `HFEngine` driven by an event loop that the pipe feeds."""
    from areal_agents.engines.hf.engine import HFEngine  # noqa: PLC0415
    from areal_agents.models.loading import load_model, quiet_transformers  # noqa: PLC0415

    keep_freed_memory()  # before the engine's threads start
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes this process
    torch.set_num_threads(1)  # this thread only loads weights; the decode thread sets its own
    quiet_transformers()
    timeline_from_env("process-engine")  # the run's timeline, when a run started this process
    try:
        engine = HFEngine.of(load_model(model_path, dtype), options, **placement)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    asyncio.run(_child_loop(conn, engine))


def _read_pipe(conn: Any, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue) -> None:
    """The child's pipe reader (a thread): every message into ``inbox``, until ``close`` or the parent is gone."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent went away
            message = ("close", None, ())
        loop.call_soon_threadsafe(inbox.put_nowait, message)
        if message[0] == "close":
            return


async def _child_loop(conn: Any, engine: Any) -> None:
    """Serve the pipe's messages: generate (answered in batches by ``done``), cancel, close, and method calls."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_read_pipe, args=(conn, loop, inbox), name="engine-pipe", daemon=True).start()
    finished: list[tuple[int, GenResponse | str]] = []
    tasks: dict[int, asyncio.Task] = {}

    def flush() -> None:
        batch = finished[:]
        finished.clear()
        conn.send(("done", None, batch))

    async def generate(key: int, request: GenRequest) -> None:
        try:
            result: GenResponse | str = await engine.agenerate(request)
        except asyncio.CancelledError:
            return
        except RequestError as e:
            result = e  # a refusal stays one in the parent (not worth retrying)
        except BaseException as e:  # noqa: BLE001  (the caller gets it as an EngineError)
            result = f"{type(e).__name__}: {e}"
        finally:
            tasks.pop(key, None)
        if not finished:
            loop.call_soon(flush)
        finished.append((key, result))

    async def control(key: int, method: str, args: tuple) -> None:
        try:
            value = getattr(engine, method)(*args)
            if asyncio.iscoroutine(value):
                value = await value
            reply = ("ok", value)
        except ArealAgentsError as e:  # a refusal (bad weights, an unknown adapter): its message says it all
            reply = ("error", f"{type(e).__name__}: {e}")
        except BaseException:  # noqa: BLE001
            reply = ("error", traceback.format_exc())
        conn.send(("reply", key, reply))

    controls = set()
    while True:
        kind, key, args = await inbox.get()
        if kind == "generate":
            for k, request in args:
                tasks[k] = asyncio.create_task(generate(k, request))
        elif kind == "cancel":
            for k in args:
                if k in tasks:
                    tasks.pop(k).cancel()
        elif kind == "close":
            break
        else:
            task = asyncio.create_task(control(key, kind, args))
            controls.add(task)
            task.add_done_callback(controls.discard)
    for task in list(tasks.values()):
        task.cancel()
    engine.close()


class ProcessEngine(LoraEngine):
    """`InferenceEngine` over an `HFEngine` in a spawned process: where the model is, the engine's
    options and placement (`HFEngine.of`)."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        options: EngineOptions | None = None,
        *,
        seed: int = 0,
        device: str = "cpu",
        compute_dtype: str = "auto",
        share_weights: bool = False,
    ) -> None:
        if share_weights:  # taken so that one set of engine arguments fits both engines
            raise ConfigError(
                "share_weights: the engine shares the trainer's tensors only in the trainer's own process "
                "(engine.weight_sync=in_process): set engine.own_process=false, or use another weight_sync"
            )
        placement = dict(seed=seed, device=device, compute_dtype=compute_dtype)
        what = f"ProcessEngine: could not start an engine for {model_path!r}"
        self._process, self._conn, _ = start_child(
            _serve,
            (model_path, dtype, options or EngineOptions(), placement),
            "hf-engine",
            EngineError,
            what,
            _START_TIMEOUT_S,
        )
        self._keys = itertools.count()
        self._lock = threading.Lock()  # guards sending and the waiting futures
        self._waiting: dict[int, asyncio.Future] = {}
        self._outbox: list[tuple[int, GenRequest]] = []
        self._error: str | None = None
        self._version = 0
        self._adapters: set[str] = set()  # the LoRA adapters the child serves
        self._reader = threading.Thread(target=self._read, name="engine-pipe", daemon=True)
        self._reader.start()

    # ---- protocol ---------------------------------------------------------------------------

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version
        self._post("set_version", (version,))

    async def agenerate(self, request: GenRequest) -> GenResponse:
        key = next(self._keys)
        future = self._expect(key)
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._send_requests)  # one message per turn of the loop
        self._outbox.append((key, request))
        try:
            return await future
        except asyncio.CancelledError:
            try:
                self._post("cancel", [key])  # its row is freed at the engine's next step
            except EngineError:
                pass  # the engine is gone: nothing to free
            raise

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    async def abort(self, rid: str | None = None) -> int:
        return await self._call("abort", rid)

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None:
        """Load new weights at a step boundary (tensors travel in shared memory) and set the version."""
        version = self._version + 1 if version is None else version
        await self._call("update_weights", state_dict, version)
        self._version = version

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        version = self._version + 1 if version is None else version
        await self._call("update_weights_from_disk", model_path, version)
        self._version = version

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> None:
        """`HFEngine.load_lora_adapter` in the engine process (``version`` None: unchanged)."""
        await self._call("load_lora_adapter", name, path, version)
        self._adapter_loaded(name, version)

    async def set_lora_adapter(
        self, name: str, weights: dict[str, torch.Tensor], config: dict[str, Any], version: int | None = None
    ) -> None:
        """`HFEngine.set_lora_adapter` in the engine process (the tensors travel in shared memory)."""
        await self._call("set_lora_adapter", name, weights, config, version)
        self._adapter_loaded(name, version)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._call("unload_lora_adapter", name)
        self._adapters.discard(name)

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters the engine process serves."""
        return sorted(self._adapters)

    def _adapter_loaded(self, name: str, version: int | None) -> None:
        self._adapters.add(name)
        if version is not None:
            self._version = version

    def flush_cache(self) -> None:
        self._post("flush_cache", ())

    async def get_stats(self) -> Any:
        """The child engine's `EngineStats`."""
        return await self._call("get_stats")

    async def counters(self) -> dict[str, float]:
        """The child engine's `EngineStats` as floats by name (`InferenceEngine.counters`)."""
        return (await self.get_stats()).counters()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine process; requests still waiting fail with `EngineError`."""
        with self._lock:
            stop_child(self._process, self._conn, ("close", None, ()))
        self._reader.join(5)

    # ---- pipe -------------------------------------------------------------------------------

    def _expect(self, key: int) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._error is not None:
                raise EngineError(self._error)
            self._waiting[key] = future
        return future

    def _post(self, kind: str, args: Any, key: int | None = None) -> None:
        with self._lock:
            if self._error is not None:
                raise EngineError(self._error)
            try:
                self._conn.send((kind, key, args))
            except (BrokenPipeError, ConnectionError, OSError):
                raise EngineError(
                    f"ProcessEngine: the engine process is gone (exit code {self._process.exitcode})"
                ) from None

    def _send_requests(self) -> None:
        batch, self._outbox = self._outbox, []
        try:
            self._post("generate", batch)
        except EngineError as e:
            self._settle([(key, e) for key, _ in batch])

    async def _call(self, method: str, *args: Any) -> Any:
        key = next(self._keys)
        future = self._expect(key)
        self._post(method, args, key)
        status, value = await future
        if status == "error":
            raise EngineError(f"ProcessEngine.{method} failed in the engine process:\n{value}")
        return value

    def _read(self) -> None:
        """The reader thread: hand each message's results to the loops of the futures waiting for them."""
        while True:
            try:
                kind, key, value = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "done":
                self._settle([(k, EngineError(r) if isinstance(r, str) else r) for k, r in value])
            else:
                self._settle([(key, value)])
        with self._lock:
            self._error = f"ProcessEngine: the engine process is gone (exit code {self._process.exitcode})"
            lost = list(self._waiting)
        self._settle([(key, EngineError(self._error)) for key in lost])

    def _settle(self, results: list[tuple[int, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any]]] = {}
        with self._lock:
            for key, result in results:
                future = self._waiting.pop(key, None)
                if future is not None:
                    by_loop.setdefault(future.get_loop(), []).append((future, result))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_set_results, items)
            except RuntimeError:  # that loop is closed: nobody is waiting any more
                pass


def _set_results(items: list[tuple[asyncio.Future, Any]]) -> None:
    for future, result in items:
        if future.done():
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
