"""``areal-agents serve-tinker``: the Tinker REST API on this machine, for the unmodified ``tinker`` SDK.

    areal-agents serve-tinker --base-model my-qwen=/ckpt/qwen --checkpoint-root /tmp/tinker --port 8000
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_tinker_script.py

Light at import: the parser builds without torch (cli.py builds every command's parser).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from areal_agents.errors import ArealAgentsError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``serve-tinker``'s flags."""
    p = sub.add_parser(
        "serve-tinker",
        help="serve the Tinker training API locally for the tinker SDK (LoRA training and sampling)",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--base-model",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a base model clients may name, a transformers checkpoint directory (repeat for more)",
    )
    p.add_argument("--tiny-families", action="store_true", help="serve tiny-<family> bases too (built at first use)")
    p.add_argument("--checkpoint-root", required=True, help="where tinker:// checkpoints are saved and loaded")
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the adapters train and the samplers run; auto: cuda when torch sees a GPU",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="train on N FSDP2 rank processes (gloo on CPU, NCCL on CUDA: rank r on the r-th GPU), as train's "
        "ppo.nproc_per_node; 1: in this process",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="the X-API-Key clients must send (default: any tml-... key)")
    p.set_defaults(fn=cmd_serve_tinker)


def base_model_dirs(pairs: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` flags as a mapping; `ArealAgentsError` naming a malformed one or a missing directory."""
    out: dict[str, Path] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise ArealAgentsError(f"--base-model: expects NAME=DIR, got {pair!r}")
        if not (Path(path) / "config.json").is_file():
            raise ArealAgentsError(f"--base-model {name}: {path} is not a checkpoint directory (no config.json)")
        out[name] = Path(path)
    return out


def cmd_serve_tinker(args: argparse.Namespace) -> None:
    dirs = base_model_dirs(args.base_model)
    if not dirs and not args.tiny_families:
        raise ArealAgentsError("--base-model: expects at least one NAME=DIR (or --tiny-families)")
    if args.nproc_per_node < 1:
        raise ArealAgentsError(f"--nproc-per-node: expects an integer >= 1, got {args.nproc_per_node}")
    import uvicorn  # noqa: PLC0415

    from areal_agents.models.device import resolve_device  # noqa: PLC0415
    from areal_agents.models.loading import quiet_transformers  # noqa: PLC0415
    from areal_agents.tinker.backend import TinkerService  # noqa: PLC0415
    from areal_agents.tinker.ownership import BaseModels  # noqa: PLC0415
    from areal_agents.tinker.rest import build_app  # noqa: PLC0415

    device = str(resolve_device(args.device))  # a cuda that torch cannot see: one line, before anything loads
    quiet_transformers()
    bases = BaseModels(dirs, allow_tiny=args.tiny_families)
    trainer = trainer_on(args.nproc_per_node, device)
    service = TinkerService(bases, args.checkpoint_root, trainer, engine_device=device)
    app = build_app(service, api_key=args.api_key)
    names = ", ".join(service.base_models.names())
    ranks = f" ({args.nproc_per_node} FSDP2 ranks)" if args.nproc_per_node > 1 else ""
    where = f"http://{args.host}:{args.port} (TINKER_BASE_URL) on {device}{ranks}"
    print(f"serve-tinker: {where}, base models: {names}", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        trainer.close()


def trainer_on(nproc: int, device: str) -> Any:
    """serve-tinker's trainer: in this process, or on ``nproc`` FSDP2 rank processes (`RankedTinkerTrainer`)."""
    from areal_agents.tinker.ranks import RankedTinkerTrainer  # noqa: PLC0415
    from areal_agents.tinker.training import TinkerTrainer  # noqa: PLC0415

    return TinkerTrainer(device=device) if nproc == 1 else RankedTinkerTrainer.spawn(nproc, device)
