"""`BroadcastSync`: new weights broadcast from the trainer to every server (``engine.weight_sync=broadcast``),
in SGLang's protocol: real SGLang servers over NCCL, serve-model over gloo.

The trainer is rank 0 of a group with every server's ranks (``/init_weights_update_group``;
`engines.broadcast_group` makes it without touching torch.distributed's default group), hosted where its
weights live: the source's `WeightSender` (this process for a trainer thread; a trainer process's or rank 0's
own, so the weights never pass through here). A push pauses the servers, then per bucket (tensors up to
``bucket_bytes``, in the state dict's order) posts ``/update_weights_from_distributed`` {names, dtypes,
shapes, group_name, flush_cache, weight_version} to every server while the sender broadcasts the bucket's
tensors, names the version and resumes (`RemoteEngine.swap_weights`).
``flush_cache`` is true after an abort pause and false with ``pause_mode=keep``, whose kept requests SGLang's
flush would fail on (`RemoteEngine.flush_with_update`).

Failures: weights with a NaN or an infinity are refused before any server is paused (the servers check
every push whole too, and keep their weights on a refusal). A server that dies or hangs mid-push fails its
call (or the broadcast, within ``timeout_s``); it leaves the engine's rotation, the group is dropped (its
peers' waits end at once), and the push starts again on a new group of the servers left, so the run goes
on with them. A server out of the rotation that answers /health again at a later push (restarted by the
supervisor, or back) joins that push's group and takes requests once it holds those weights: rejoining at
the next push needs no disk copy and gives it exactly the weights the others serve. Servers that restart
lose broadcast weights, so the engine takes a restarted or unanswering server out at once
(`RemoteEngine.guard_restarts`).

    sync = BroadcastSync([engine], dtype="bfloat16", bucket_bytes=512 << 20, timeout_s=120)
    await sync.push(policy)   # every server in the rotation serves the policy's weights as version + 1
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from areal_agents.engines.broadcast_group import dtype_name, local_address, plan_buckets
from areal_agents.engines.remote_engine import ServerError
from areal_agents.engines.weight_sender import GroupSpec, WeightSender, WireWeights
from areal_agents.engines.weight_sync import WeightSource, timed
from areal_agents.errors import ConfigError, EngineError, RequestError
from areal_agents.models.weight_files import tensor_bytes
from areal_agents.net import free_port

AFTER_FAILURE_S = 10.0  # after a failed broadcast, the servers' replies are waited for this long
_groups = itertools.count(1)  # numbers a group in this process's log; `group_name` makes it unique beyond it


class BroadcastSync:
    """A `WeightSync` over SGLang's broadcast protocol; see the module docstring. ``engines``: `RemoteEngine`
    clients (`SGLangEngine`); ``dtype``: what the servers receive (None: the trainer's); ``backend``: ``gloo``,
    ``nccl`` or ``auto`` (NCCL for tensors on CUDA); ``supervisor``: the launcher's `Supervisor`, if any."""

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        dtype: str | None = None,
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 120.0,
        backend: str = "auto",
        tp_size: int = 1,
        supervisor: Any = None,
    ) -> None:
        if backend not in ("auto", "gloo", "nccl"):
            raise EngineError(f"BroadcastSync backend: expects auto, gloo or nccl, got {backend!r}")
        import torch  # noqa: PLC0415

        if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ConfigError(f"weight dtype: expects a torch dtype name such as bfloat16, got {dtype!r}")
        self.engines = list(engines)
        self.dtype, self.bucket_bytes, self.timeout_s = dtype, bucket_bytes, timeout_s
        self.backend, self.tp_size = backend, tp_size
        self.groups: dict[int, tuple[list[int], SenderGroup]] = {}  # engine -> (its member servers, the group)
        self.last_push: dict[str, float] = {}
        for engine in self.engines:
            engine.guard_restarts(supervisor)

    async def push(self, source: WeightSource, version: int | None = None) -> int:
        start = time.perf_counter()
        version = self.engines[0].get_version() + 1 if version is None else version
        sender = source.weight_sender()  # where the weights live: this process, or the trainer's rank 0
        described = await sender.describe(self.dtype, self.backend)
        if described.nonfinite:  # the servers would refuse them after the whole broadcast; no server is paused
            nonfinite = described.nonfinite
            more = f" (and {len(nonfinite) - 3} more)" if len(nonfinite) > 3 else ""
            raise EngineError(
                f"weight broadcast of version {version}: {', '.join(nonfinite[:3])}{more} have NaN or infinite "
                "values as sent; no server was touched"
            )
        buckets = plan_buckets(described.wire, self.bucket_bytes)
        for i, engine in enumerate(self.engines):
            members = await self._candidates(engine)  # before the pause, which goes to the rotation

            async def load(v: int, i: int = i, engine: Any = engine, members: list[int] = members) -> None:
                await self._load(i, engine, members, Push(sender, described, buckets, v))

            await engine.swap_weights(load, version)  # lock, pause, load, version, resume
        self.last_push = timed(start, tensor_bytes(described.wire))
        return version

    async def announce(self, version: int) -> None:
        for engine in self.engines:
            engine.set_version(version)
            await engine.announce_version()

    def close(self) -> None:
        """Leave every group (the servers' ends fail their next wait)."""
        for _, group in self.groups.values():
            group.close()
        self.groups.clear()

    # ---- one engine's push ----------------------------------------------------------------------

    async def _load(self, i: int, engine: Any, members: list[int], push: Push) -> None:
        """Every server of ``members`` gets the weights and takes requests; those that fail leave the rotation.
        A group is kept from push to push unless a member was out of the rotation (it may have restarted
        and left the group); a broadcast that fails while every server answers gets one new group."""
        rejoining = {m for m in members if m in engine.out}
        if i in self.groups and rejoining & set(self.groups[i][0]):
            self._drop(i)
        retried = False
        while members:
            group = await self._group(i, engine, members, push)
            if group is None:
                break
            members = self.groups[i][0]  # those that joined
            lost, failure = await self._send(engine, members, group, push)
            if not lost and failure is None:
                for m in members:
                    engine.put_back(m)
                return
            self._drop(i)
            if not lost:
                if retried:
                    raise EngineError(f"weight broadcast failed twice and every server answers: {failure}")
                retried = True  # a member restarted unseen since the group was made: a new group
            members = [m for m in members if m not in lost]
        raise EngineError(f"no server took the weights of version {push.version}: {engine.out}")

    async def _candidates(self, engine: Any) -> list[int]:
        """The servers whose /health answers: those in the rotation, and those out of it, which rejoin; one
        in the rotation that does not answer leaves it (a group waits for every rank it names)."""
        engine.in_rotation()  # takes out the servers the supervisor restarted since the last look
        indices = range(len(engine.addresses))
        answers = await asyncio.gather(*(engine.healthy(i) for i in indices))
        for i, ok in zip(indices, answers):
            if not ok and i not in engine.out:
                engine.take_out(i, "did not answer /health before a weight push")
        return [i for i, ok in zip(indices, answers) if ok]

    async def _group(self, i: int, engine: Any, members: list[int], push: Push) -> SenderGroup | None:
        """The group of ``members`` (the current one if it has exactly them and the push's sender), or None
        if none joined."""
        backend = push.described.backend
        if i in self.groups and self.groups[i][0] == members and self.groups[i][1].serves(push.sender, backend):
            return self.groups[i][1]
        await self._forget(i, engine)
        while members:
            name = group_name()
            host = urlsplit(engine.addresses[members[0]]).hostname or "127.0.0.1"
            master = local_address(host, urlsplit(engine.addresses[members[0]]).port or 80)
            port = free_port(master)
            world = 1 + len(members) * self.tp_size
            posts = [
                engine.post_once(
                    engine.addresses[m],
                    "/init_weights_update_group",
                    {
                        "master_address": master,
                        "master_port": port,
                        "rank_offset": 1 + k * self.tp_size,
                        "world_size": world,
                        "group_name": name,
                        "backend": backend,
                    },
                    self.timeout_s + 10,
                )
                for k, m in enumerate(members)
            ]
            group = SenderGroup(name, backend, push.sender)
            rank0 = push.sender.join(GroupSpec(master, port, world, name, backend, self.timeout_s))
            *replies, joined = await asyncio.gather(*posts, rank0, return_exceptions=True)
            failed = [m for m, r in zip(members, replies) if isinstance(r, BaseException)]
            if not failed and not isinstance(joined, BaseException):
                self.groups[i] = (list(members), group)
                return group
            group.close()
            for m, r in zip(members, replies):
                if isinstance(r, BaseException):
                    engine.take_out(m, f"could not join the weight group: {r}")
            if not failed:  # every server joined but rank 0 could not: nothing a retry would change
                raise EngineError(f"the trainer could not make the weight group {name}: {joined}")
            members = [m for m in members if m not in failed]
        return None

    async def _send(
        self, engine: Any, members: list[int], group: SenderGroup, push: Push
    ) -> tuple[set[int], BaseException | None]:
        """Every bucket of ``push`` to ``members``: the servers lost on the way and the broadcast's failure
        (nothing lost, no failure: all hold the weights)."""
        wire = push.described.wire
        for names in push.buckets:
            body = {
                "names": names,
                "dtypes": [dtype_name(wire[n].dtype) for n in names],
                "shapes": [list(wire[n].shape) for n in names],
                "group_name": group.name,
                "flush_cache": engine.flush_with_update(),
                "abort_all_requests": False,
                "weight_version": str(push.version),
            }
            path, timeout = "/update_weights_from_distributed", self.timeout_s + 10
            posts = [asyncio.ensure_future(engine.post_once(engine.addresses[m], path, body, timeout)) for m in members]
            failure: BaseException | None = None
            try:
                await push.sender.send(group.name, names)
            except Exception as e:  # noqa: BLE001  (a rank gone, or the timeout)
                failure = e
                group.close()  # the servers still waiting in this bucket fail at once
            replies = await _replies(posts, grace_s=None if failure is None else AFTER_FAILURE_S)
            lost = await self._lost(engine, members, replies, failure)
            if failure is not None:  # a server's refusal (4xx) closed the group: its reason, not the broadcast's
                return lost, next((r for r in replies if isinstance(r, RequestError)), failure)
            if lost:
                return lost, None
        return set(), None

    async def _lost(self, engine: Any, members: list[int], replies: list, failure: BaseException | None) -> set[int]:
        """The servers a bucket lost, taken out of the rotation: those whose call failed (after a failed
        broadcast, which fails every call: those that no longer answer /health)."""
        lost = set()
        for m, reply in zip(members, replies):
            if not isinstance(reply, BaseException):
                continue
            gone = getattr(reply, "status", 0) is None or not await engine.healthy(m)
            if failure is None or gone:
                engine.take_out(m, f"failed a weight push: {reply}")
                lost.add(m)
        return lost

    async def _forget(self, i: int, engine: Any) -> None:
        """Drop engine ``i``'s group and ask its servers still in the rotation to leave it (best effort)."""
        if i not in self.groups:
            return
        members, group = self.groups.pop(i)
        group.close()
        body = {"group_name": group.name}
        leave = [engine.post_once(engine.addresses[m], "/destroy_weights_update_group", body, 10) for m in members]
        await asyncio.gather(*leave, return_exceptions=True)  # SGLang before 0.5.x has no such route

    def _drop(self, i: int) -> None:
        members_group = self.groups.pop(i, None)
        if members_group is not None:
            members_group[1].close()


@dataclass(frozen=True)
class Push:
    """One push: its sender, what it sends, in which buckets, under which version."""

    sender: WeightSender
    described: WireWeights
    buckets: list[list[str]]
    version: int


@dataclass
class SenderGroup:
    """A weight group as this process sees it: its name and backend, hosted by ``sender``."""

    name: str
    backend: str
    sender: WeightSender

    def serves(self, sender: WeightSender, backend: str) -> bool:
        return self.sender is sender and self.backend == backend

    def close(self) -> None:
        """The sender leaves the group (the servers' ends fail their next wait)."""
        self.sender.leave(self.name)


def group_name() -> str:
    """A new weight group's name: ``areal_weights_N_TOKEN``, N counting this process's groups and TOKEN random.
    A server keeps the groups it joined by name, so a name must never come back: a restarted trainer's
    counter starts at 1 again while the running servers still hold the old trainer's ``areal_weights_1``."""
    return f"areal_weights_{next(_groups)}_{secrets.token_hex(6)}"


async def _replies(posts: list[asyncio.Future], grace_s: float | None) -> list:
    """The posts' replies or errors; with ``grace_s``, a post still unanswered that long after a failed
    broadcast (its server hangs) counts as unreachable."""
    if grace_s is not None:
        _, pending = await asyncio.wait(posts, timeout=grace_s)
        for post in pending:
            post.cancel()
    out: list = []
    for post in posts:
        if post.cancelled():
            out.append(ServerError("", None, f"no reply {grace_s:.0f}s after the broadcast failed"))
            continue
        try:
            out.append(await post)
        except Exception as e:  # noqa: BLE001  (the server's failure, judged by `_lost`)
            out.append(e)
    return out
