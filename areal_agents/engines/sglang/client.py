"""`SGLangEngine`: the `InferenceEngine` client for SGLang servers (or `serve-model`), interruptible.

    engine = SGLangEngine(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], weights_dir="runs/x/weights")
    resp = await engine.agenerate(GenRequest("episode7/t0", prompt_ids, SamplingParams(max_new_tokens=256)))
    await engine.update_weights(policy.state_dict())   # pause all (abort), load from disk, continue

Requests go round-robin over the servers, with episode stickiness: requests whose rid shares the prefix
before the last ``/`` (``episode7/t0``, ``episode7/t1``) go to the same server, so its prefix cache
holds the conversation. When a server answers ``finish_reason: abort`` (a weight update paused it), the
request is resubmitted as prompt + tokens so far with the remaining budget, and tokens, logprobs and
versions are concatenated.

Retries: connection errors, client timeouts and 5xx replies are retried with exponential backoff; after
``max_retries`` the request fails with `EngineError`. Errors the server would repeat are not retried and
raise at once with the server's message: a 4xx (bad input; 408 and 429 excepted), a 501, and a 500 from a
server whose ``/health`` answers 200 (the request itself fails there, e.g. a sampling key the server's
SGLang version does not know). Every /generate attempt carries a fresh server-side request id (the
``rid`` plus ``#`` and a random suffix), and an attempt given up on (client timeout, dropped connection,
cancelled caller) is aborted with ``/abort_request``, so it does not keep generating beside its retry.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp

from areal_agents.engines.sglang.protocol import ProtocolError, read_generate_response
from areal_agents.errors import EngineError, RequestError
from areal_agents.types import GenRequest, GenResponse


class ServerError(EngineError):
    """A server replied with an error status (``status``) or could not be reached (``status`` None)."""

    def __init__(self, url: str, status: int | None, message: str) -> None:
        super().__init__(f"{url}: {message}" if status is None else f"{url}: HTTP {status}: {message}")
        self.url, self.status = url, status


class SGLangEngine:
    """An `InferenceEngine` over SGLang-native HTTP servers; see the module docstring."""

    def __init__(
        self,
        addresses: list[str],
        *,
        weights_dir: str | None = None,
        request_timeout_s: float = 3600.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        version: int = 0,
        max_sticky_episodes: int = 100_000,
    ) -> None:
        if not addresses:
            raise EngineError("SGLangEngine needs at least one server address")
        self.addresses = [a.rstrip("/") if "://" in a else f"http://{a.rstrip('/')}" for a in addresses]
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.request_timeout_s, self.max_retries, self.backoff_s = request_timeout_s, max_retries, backoff_s
        self._version = version
        self._names: dict[str, int] = {}  # weight_version strings the servers report -> our int versions
        self._round_robin = itertools.cycle(range(len(self.addresses)))
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max_sticky = max_sticky_episodes
        self._resumed: asyncio.Event | None = None
        self._paused = False
        self._session: aiohttp.ClientSession | None = None
        self._update_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = collections.Counter()

    # ---- protocol ---------------------------------------------------------------------------

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    async def announce_version(self) -> None:
        """Have every server tag its tokens with this client's version (a resumed run's servers start
        as "default", and clients in other processes read versions from the servers)."""
        await self._all("/update_weight_version", {"new_version": str(self._version), "abort_all_requests": False})
        self._names[str(self._version)] = self._version

    async def agenerate(self, request: GenRequest) -> GenResponse:
        start = time.perf_counter()
        sp = request.sampling
        url = self.addresses[self._server_for(request.rid)]
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            await self._wait_resumed()
            remaining = sp.max_new_tokens - len(tokens)
            body = {
                "input_ids": request.input_ids + tokens,
                "sampling_params": {
                    "max_new_tokens": remaining,
                    "temperature": sp.temperature,
                    "top_p": sp.top_p,
                    "top_k": sp.top_k if sp.top_k > 0 else -1,
                    "stop_token_ids": list(sp.stop_token_ids),
                    "ignore_eos": sp.ignore_eos,
                    "skip_special_tokens": False,
                    "no_stop_trim": True,
                },
                "return_logprob": True,
            }
            submitted_version = self._version
            reply = await self._post(url, "/generate", body, rid=request.rid)
            try:
                part = read_generate_response(reply)
            except ProtocolError as e:
                raise EngineError(f"{url}/generate: {e}") from e
            tokens += part.tokens
            logprobs += part.logprobs
            versions += [self._to_int(v, submitted_version) for v in part.versions]
            self.stats["requests"] += 1
            if part.finish != "abort":
                return GenResponse(tokens, logprobs, versions, part.finish, time.perf_counter() - start)
            self.stats["resubmitted"] += 1
            if len(tokens) >= sp.max_new_tokens:
                return GenResponse(tokens, logprobs, versions, "length", time.perf_counter() - start)

    async def pause(self) -> None:
        """Interrupt every server: in-flight requests come back ``abort`` and wait here for `resume`."""
        self._paused = True
        self._ensure_primitives()
        self._resumed.clear()
        await self._all("/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        await self._all("/continue_generation", {})
        self._paused = False
        self._ensure_primitives()
        self._resumed.set()

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None:
        """Write ``state_dict`` as safetensors under ``weights_dir`` and have every server load it."""
        version = self._version + 1 if version is None else version
        path = self.weights_path(version)
        await asyncio.to_thread(write_weights, state_dict, path)
        await self.update_weights_from_disk(str(path), version)
        self.prune_weights(version)

    def weights_path(self, version: int) -> Path:
        """Where the weights of ``version`` are written for the servers to load."""
        if self.weights_dir is None:
            raise EngineError("SGLangEngine.update_weights needs weights_dir (a directory the servers can read)")
        return self.weights_dir / f"v{version}"

    def prune_weights(self, version: int) -> None:
        """Delete written weights older than the version before ``version``."""
        for old in self.weights_path(version).parent.glob("v*"):
            if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        """Pause all servers (abort), load ``model_path`` on each, tag the new version, continue."""
        self._ensure_primitives()
        version = self._version + 1 if version is None else version
        async with self._update_lock:
            was_paused = self._paused
            await self.pause()
            try:
                body = {"model_path": model_path, "weight_version": str(version), "abort_all_requests": True}
                replies = await self._all("/update_weights_from_disk", body)
                failed = [(url, r) for url, r in zip(self.addresses, replies) if not r.get("success", False)]
                if failed:
                    raise EngineError(f"update_weights_from_disk failed on {failed[0][0]}: {failed[0][1]}")
                self._names[str(version)] = version
                self._version = version
            finally:
                if not was_paused:
                    await self.resume()

    async def init_weights_update_group(
        self, master_address: str, master_port: int, *, tp_size: int = 1, group_name: str = "weight_update_group"
    ) -> int:
        """GPU path: every server's tp ranks join an NCCL group with the trainer as rank 0; returns its size.

        The trainer joins the same group concurrently, e.g. with SGLang's
        ``init_custom_process_group(backend="nccl", init_method=f"tcp://{addr}:{port}", world_size=size,
        rank=0, group_name=group_name)``. Written against SGLang 0.5.x; not runnable on a CPU-only machine.
        """
        world_size = 1 + len(self.addresses) * tp_size
        await asyncio.gather(
            *(
                self._post(
                    url,
                    "/init_weights_update_group",
                    {
                        "master_address": master_address,
                        "master_port": master_port,
                        "rank_offset": 1 + i * tp_size,
                        "world_size": world_size,
                        "group_name": group_name,
                        "backend": "nccl",
                    },
                )
                for i, url in enumerate(self.addresses)
            )
        )
        return world_size

    async def update_weights_from_distributed(
        self,
        named_tensors: list[tuple[str, Any]],
        broadcast,
        *,
        version: int | None = None,
        group_name: str = "weight_update_group",
    ) -> None:
        """GPU path: announce names/dtypes/shapes to every server, then ``broadcast(tensor)`` each from rank 0.

        ``broadcast`` is the trainer's ``torch.distributed.broadcast`` on the group made by
        `init_weights_update_group` (not runnable here: no NCCL).
        """
        self._ensure_primitives()
        version = self._version + 1 if version is None else version
        async with self._update_lock:
            await self.pause()
            try:
                body = {
                    "names": [n for n, _ in named_tensors],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
                    "shapes": [list(t.shape) for _, t in named_tensors],
                    "group_name": group_name,
                    "weight_version": str(version),
                    "abort_all_requests": True,
                }
                posted = asyncio.ensure_future(self._all("/update_weights_from_distributed", body))
                for _, tensor in named_tensors:
                    await asyncio.to_thread(broadcast, tensor)
                replies = await posted
                failed = [r for r in replies if not r.get("success", False)]
                if failed:
                    raise EngineError(f"update_weights_from_distributed failed: {failed[0]}")
                self._names[str(version)] = version
                self._version = version
            finally:
                await self.resume()

    async def health(self) -> list[bool]:
        """Whether each server answers /health now (no retries)."""
        return list(await asyncio.gather(*(self._healthy(u) for u in self.addresses)))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- internals ----------------------------------------------------------------------------

    def _server_for(self, rid: str) -> int:
        episode = rid.rsplit("/", 1)[0]
        if episode in self._sticky:
            self._sticky.move_to_end(episode)
            return self._sticky[episode]
        index = next(self._round_robin)
        self._sticky[episode] = index
        if len(self._sticky) > self._max_sticky:
            self._sticky.popitem(last=False)
        return index

    def _to_int(self, name: str | None, default: int) -> int:
        if name is None:
            return default
        if name in self._names:
            return self._names[name]
        try:
            return int(name)
        except ValueError:
            return default  # e.g. SGLang's initial "default"

    def _ensure_primitives(self) -> None:
        """asyncio primitives for the running loop (a second asyncio.run gets fresh ones)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._resumed = asyncio.Event()
            if not self._paused:
                self._resumed.set()
            self._update_lock = asyncio.Lock()
            self._session = None  # bound to the old loop

    async def _wait_resumed(self) -> None:
        self._ensure_primitives()
        await self._resumed.wait()

    def _client(self) -> aiohttp.ClientSession:
        self._ensure_primitives()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def _all(self, path: str, body: dict) -> list[dict]:
        return list(await asyncio.gather(*(self._post(url, path, body) for url in self.addresses)))

    async def _post(self, url: str, path: str, body: dict, rid: str | None = None) -> dict:
        """POST with retries on connection errors, timeouts and transient 5xx; errors the server would
        repeat raise at once (see the module docstring). With ``rid``, each attempt sends a fresh
        ``rid#suffix`` and one given up on is aborted on the server."""
        delay = self.backoff_s
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if rid is not None:
                body = {**body, "rid": f"{rid}#{secrets.token_hex(4)}"}
            try:
                timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
                async with self._client().post(f"{url}{path}", json=body, timeout=timeout) as r:
                    text = await r.text()
                    if r.status >= 400:
                        message = _message(text)
                        if not await self._transient(url, r.status):
                            refused = RequestError if 400 <= r.status < 500 else EngineError  # the request itself
                            raise refused(f"{url}{path}: HTTP {r.status}: {message}{_NOT_RETRIED.get(r.status, '')}")
                        raise ServerError(url, r.status, message)
                    if not text.strip():
                        return {}
                    try:
                        return await r.json(content_type=None)
                    except ValueError as e:
                        raise ServerError(url, r.status, f"reply is not JSON: {text[:200]}") from e
            except ServerError as e:
                last = e
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                last = ServerError(url, None, f"{type(e).__name__}: {e}")
                if rid is not None:  # it may still be running there
                    await self._abort(url, body["rid"])
            except asyncio.CancelledError:
                if rid is not None:
                    await self._abort(url, body["rid"])
                raise
            if attempt < self.max_retries:
                self.stats["retries"] += 1
                await asyncio.sleep(delay)
                delay *= 2
        raise EngineError(f"{url}{path} failed after {self.max_retries + 1} attempts: {last}")

    async def _transient(self, url: str, status: int) -> bool:
        """Whether an error reply may go away on a retry: not a 4xx (but 408, 429), not a 501, and not a
        500 from a server that is healthy (the request itself fails there and would again)."""
        if status in (408, 429):
            return True
        if status < 500 or status == 501:
            return False
        if status == 500:
            return not await self._healthy(url)
        return True

    async def _healthy(self, url: str) -> bool:
        try:
            async with self._client().get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            return False

    async def _abort(self, url: str, rid: str) -> None:
        """Best effort: ask ``url`` to stop request ``rid`` (shielded from the caller's cancellation)."""

        async def post() -> None:
            timeout = aiohttp.ClientTimeout(total=5)
            async with self._client().post(f"{url}/abort_request", json={"rid": rid}, timeout=timeout) as r:
                await r.read()

        try:
            await asyncio.shield(post())
            self.stats["aborted"] += 1
        except (TimeoutError, aiohttp.ClientError, ConnectionError, asyncio.CancelledError):
            pass  # the server is gone, or the caller is cancelled again: nothing more to do


_NOT_RETRIED = {500: " (not retried: the server is healthy, so the request itself fails there)"}


def _message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return text[:300]


def write_weights(state_dict: dict[str, Any], path: str | Path) -> None:
    """``state_dict`` as ``path/model.safetensors`` (what /update_weights_from_disk loads)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    Path(path).mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    save_file(_untie(tensors), str(Path(path) / "model.safetensors"))


def _untie(tensors: dict) -> dict:
    """safetensors refuses shared storage (tied embeddings): give each tensor its own."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out
