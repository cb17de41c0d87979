"""`RankedTinkerTrainer`: serve-tinker's trainer on ``--nproc-per-node`` FSDP2 ranks, each a process running
a `TinkerTrainer` of its own over the sharded base (`tinker.sharding`), reached as `train` reaches its trainer
ranks (`PipeTransport`: torchrun's environment, gloo on CPU, NCCL on CUDA).

Every call goes to every rank in one order (the transport's lock), so their collectives meet; rank 0's answer
comes back. A request the client got wrong fails the same way on every rank (validation is deterministic and
a non-finite loss is agreed on), and comes back as the `TinkerUserError` it was.

    trainer = RankedTinkerTrainer.spawn(2, "cpu")
    trainer.create_model("s:train:0", "runs/tiny", rank=8)      # as TinkerTrainer's methods
    trainer.close()
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from areal_agents.errors import TinkerUserError
from areal_agents.tinker.sampler import Snapshot
from areal_agents.tinker.training import MICRO_BATCH_TOKENS, ForwardBackwardOutput, SnapshotSampling, TinkerTrainer
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.trainer_endpoint import UnknownTrainerCall
from areal_agents.trainers.trainer_process import PipeTransport, RankOptions

# the TinkerTrainer methods a rank answers; those that return a TrainingModel answer None (it holds the model)
CALLS = (
    "create_model",
    "drop_model",
    "forward_backward",
    "optim_step",
    "save_state",
    "load_state",
    "sampler_snapshot",
    "prompt_logprobs",
)
RETURNS_MODEL = ("create_model", "load_state")


class TinkerEndpoint:
    """One rank's answers: ``("ok", value)`` or ``("user", message)`` for a `TinkerUserError` (a pipe carries
    the rest of a rank's errors as its traceback)."""

    def __init__(self, trainer: TinkerTrainer) -> None:
        self.trainer = trainer

    def call(self, method: str, args: tuple) -> tuple[str, Any]:
        if method not in CALLS:
            raise UnknownTrainerCall(f"a Tinker rank answers {sorted(CALLS)}, not {method!r}")
        try:
            value = getattr(self.trainer, method)(*args)
        except TinkerUserError as e:
            return "user", str(e)
        return "ok", None if method in RETURNS_MODEL else value


def tinker_endpoint(dp: DataParallel | None, dtype: str, micro_batch_tokens: int) -> tuple[TinkerEndpoint, None]:
    """A rank's endpoint (`PipeTransport.start`'s ``build``): a `TinkerTrainer` on this rank's device."""
    return TinkerEndpoint(TinkerTrainer(dtype, micro_batch_tokens=micro_batch_tokens, dp=dp)), None


class RankedTinkerTrainer(SnapshotSampling):
    """`TinkerTrainer`'s methods, run on every rank of ``transport``; ``models`` holds the ids that exist.
    Samples run on this process's engine, their prompt logprobs on the ranks."""

    def __init__(self, transport: PipeTransport) -> None:
        self.transport = transport
        self.models: dict[str, None] = {}
        self._closed = False

    @classmethod
    def spawn(
        cls,
        nproc: int,
        device: str,
        dtype: str = "float32",
        threads: int = 0,
        micro_batch_tokens: int = MICRO_BATCH_TOKENS,
    ) -> RankedTinkerTrainer:
        """``nproc`` rank processes on ``device`` (cuda: rank r on the r-th visible GPU), ``threads`` intra-op
        threads among them (0: this process's team); `TrainerProcessError` if one fails to start."""
        how = RankOptions(threads, 0, device, "tinker-trainer")
        args = (dtype, micro_batch_tokens)
        return cls(PipeTransport.start("tinker", tinker_endpoint, args, how, nproc))

    def _call(self, method: str, *args: Any) -> Any:
        status, value = self.transport.call(method, *args)
        if status == "user":
            raise TinkerUserError(value)
        return value

    def create_model(self, model_id: str, base_model_dir: str, rank: int, **options: Any) -> None:
        self._call("create_model", *_positional(TinkerTrainer.create_model, model_id, base_model_dir, rank, **options))
        self.models[model_id] = None

    def drop_model(self, model_id: str) -> None:
        self._call("drop_model", model_id)
        self.models.pop(model_id, None)

    def forward_backward(
        self,
        model_id: str,
        datums: list[tuple[list[int], Any]],
        loss_fn: str,
        config: dict[str, Any] | None = None,
        forward_only: bool = False,
    ) -> ForwardBackwardOutput:
        return self._call("forward_backward", model_id, list(datums), loss_fn, config, forward_only)

    def optim_step(self, model_id: str, **params: float) -> dict[str, float]:
        return self._call("optim_step", *_positional(TinkerTrainer.optim_step, model_id, **params))

    def save_state(self, model_id: str, path: str | Path, optimizer: bool = True) -> None:
        self._call("save_state", model_id, str(path), optimizer)

    def load_state(self, path: str | Path, model_id: str, with_optimizer: bool) -> None:
        self.models.pop(model_id, None)  # replaced: gone until the load succeeds
        self._call("load_state", str(path), model_id, with_optimizer)
        self.models[model_id] = None

    def sampler_snapshot(self, model_id: str) -> Snapshot:
        return self._call("sampler_snapshot", model_id)

    def prompt_logprobs(self, snapshot: Snapshot, tokens: list[int]) -> list[float | None]:
        return self._call("prompt_logprobs", snapshot, list(tokens))

    def close(self) -> None:
        """Stop the rank processes (once: the server's shutdown and the command's both close it)."""
        if not self._closed:
            self._closed = True
            self.transport.close()


def _positional(method: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``method``'s arguments (after self) all positional, its defaults filled in (a pipe carries positional
    arguments); `TypeError` for a keyword it does not take."""
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound.args[1:]
