"""`areal-agents` command line: build, train, evaluate and serve multi-turn RL agents.

User mistakes (a missing config file, an unknown key or env id, a bad model path) print one line and
exit with code 2, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from areal_agents.config.loading import config_help as _config_help  # light: every parser lists config keys
from areal_agents.errors import ArealAgentsError
from areal_agents.tinker.command import add_parser as _add_serve_tinker  # light: its parser, no torch


def _quiet_transformers() -> None:
    from areal_agents.models.loading import quiet_transformers

    quiet_transformers()


def cmd_tiny_model(args: argparse.Namespace) -> None:
    from areal_agents.models.tiny import save_tiny_model

    _quiet_transformers()
    context = {} if args.context is None else {"max_position_embeddings": args.context}
    out = save_tiny_model(
        args.out_dir, seed=args.seed, overwrite=args.overwrite, preset=args.preset, family=args.family, **context
    )
    print(f"{args.preset} model and {args.family} tokenizer saved to {out}")


def cmd_train(args: argparse.Namespace) -> None:
    from areal_agents.config import TrainConfig, load_config

    cfg = load_config(TrainConfig, args.config, args.overrides)  # config errors before importing torch
    from areal_agents.trainers.resume import claim_run_dir

    claim_run_dir(cfg.run_dir, "train", resume=args.resume, overwrite=args.overwrite)
    from areal_agents.cluster import open_launcher
    from areal_agents.trainers.rl_recipe import run_train

    _quiet_transformers()
    launcher = open_launcher(cfg)  # this machine, or Ray (launcher=ray)
    run_train(
        cfg,
        progress=not args.no_progress,
        resume=args.resume,
        allow_config_change=args.allow_config_change,
        launcher=launcher,
    )


def cmd_sft(args: argparse.Namespace) -> None:
    from areal_agents.config import SFTConfig, load_config

    cfg = load_config(SFTConfig, args.config, args.overrides)  # config errors before importing torch
    from areal_agents.trainers.resume import claim_run_dir

    claim_run_dir(cfg.run_dir, "sft", overwrite=args.overwrite)
    from areal_agents.trainers.sft_recipe import run_sft

    _quiet_transformers()
    run_sft(cfg, progress=not args.no_progress)


def cmd_envs(args: argparse.Namespace) -> None:
    from areal_agents.envs.registry import describe_envs, import_env_module

    for module in args.module:
        import_env_module(module)
    rows = describe_envs(include_gymnasium=args.all)
    width = max((len(i) for i, _ in rows), default=0)
    for env_id, description in rows:
        print(f"{env_id:<{width}}  {description}")


def cmd_serve_env(args: argparse.Namespace) -> None:
    from areal_agents.envs.registry import import_env_module
    from areal_agents.envs.runtime.server import ServerConfig, serve

    for module in args.module:
        import_env_module(module)
    cfg = ServerConfig(
        host=args.host,
        port=args.port,
        mode=args.mode,
        workers=args.workers,
        step_timeout=args.step_timeout,
        idle_timeout=args.idle_timeout,
        max_sessions=args.max_sessions,
        max_action_chars=args.max_action_chars,
        max_body_bytes=args.max_body_bytes,
        modules=list(args.module),
        datasets=list(args.dataset),
        data_dirs=list(args.data_dir),
    )
    serve(cfg)


def cmd_check_env_server(args: argparse.Namespace) -> int:
    from areal_agents.envs.runtime.conformance import run_cli

    options = {"action": args.action, "max_steps": args.max_steps, "session_probe_limit": args.session_probe_limit}
    options.update(multi_agent_env=args.multi_agent_env, multi_agent_kwargs=args.multi_agent_kwargs)
    return run_cli(args.url, args.env_id, args.kwargs, strict=args.strict, **options)


def cmd_eval(args: argparse.Namespace) -> None:
    from pathlib import Path

    from areal_agents.config import load_config
    from areal_agents.envs.registry import import_env_module
    from areal_agents.eval.options import EvalOptions, with_flags
    from areal_agents.eval.runner import print_summary, run_eval

    cli_only = ("fn", "command", "config", "overrides", "no_progress", "overwrite")
    flags = {k: v for k, v in vars(args).items() if k not in cli_only}
    opts = with_flags(load_config(EvalOptions, args.config, args.overrides), flags)
    opts.check()
    for module in opts.modules():
        import_env_module(module)
    _quiet_transformers()
    settings, engine, progress = opts.settings(), opts.engine_config(), not args.no_progress
    kwargs = {"progress": progress, "new_dir_on_mismatch": not opts.out, "overwrite": args.overwrite}
    summary = run_eval(settings, opts.model, opts.out_dir(), engine=engine, **kwargs)
    out = summary["out"]  # OUT-2, ... when OUT holds another run's samples and --out was not given
    print_summary(summary, title=f"{opts.dataset or opts.env.id} ({opts.model})")
    print(f"samples: {Path(out) / 'samples.jsonl'}\nsummary: {Path(out) / 'summary.json'}")


def cmd_datasets(args: argparse.Namespace) -> None:
    from areal_agents.data.builtin import BUILTIN

    rows = []
    for d in BUILTIN.values():
        for split in d.files:
            with d.path(split).open(encoding="utf-8") as f:
                count = sum(1 for line in f if line.strip())
            rows.append((d.name, split, str(count), d.licence, d.description))
    widths = [max(len(r[k]) for r in [("name", "split", "rows", "licence", ""), *rows]) for k in range(4)]
    for r in [("name", "split", "rows", "licence", "what"), *rows]:
        print("  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) + "  " + r[4])
    print("origins and licences: " + str(next(iter(BUILTIN.values())).path().with_name("SOURCES.md")))


def cmd_eval_report(args: argparse.Namespace) -> None:
    from areal_agents.eval.report import compare

    print(compare(args.runs))


def cmd_plot(args: argparse.Namespace) -> None:
    from areal_agents.trainers.plots import plot_run

    for path in plot_run(args.run_dir):
        print(path)


def cmd_trace(args: argparse.Namespace) -> None:
    from areal_agents.timeline.trace import trace_command

    trace_command(args.run_dir, args.out)


def cmd_dashboard(args: argparse.Namespace) -> None:
    from areal_agents.dashboard import serve

    serve(args.runs, host=args.host, port=args.port)


def cmd_serve_model(args: argparse.Namespace) -> None:
    from areal_agents.config import EngineOptions
    from areal_agents.engines.model_server import ModelServerConfig, serve_model
    from areal_agents.engines.process_malloc import keep_freed_memory
    from areal_agents.engines.server_control import admin_key_from_env

    # every field of the configs is a flag of the same name (admin_key: from $AREAL_ADMIN_KEY when not given)
    try:
        engine = EngineOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineOptions)})
    except ValueError as e:  # "field: expects ...": name its flag too
        key, _, why = str(e).partition(": ")
        raise ArealAgentsError(f"{key} (--{key.replace('_', '-')}): {why}") from None
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelServerConfig) if f.name != "engine"}
    given["admin_key"] = admin_key_from_env(args.admin_key)
    cfg = ModelServerConfig(**given, engine=engine)
    keep_freed_memory()  # the flags are good: before any thread starts, the process's malloc keeps what it frees
    serve_model(cfg, device=args.device)


def cmd_export_lora(args: argparse.Namespace) -> None:
    from areal_agents.trainers.lora import export_lora

    _quiet_transformers()
    out = args.merge or args.adapter
    given = {"policy": args.policy, "base": args.base, "overwrite": args.overwrite}
    print(export_lora(args.run_dir, out, merge=bool(args.merge), **given))


class _Parser(argparse.ArgumentParser):
    """Its description may be a function, called when its help is shown (eval's imports torch: seconds)."""

    def format_help(self) -> str:
        self.description = self.description() if callable(self.description) else self.description
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areal-agents", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_tiny_model, _add_recipes, _add_eval, _add_tools, _add_dashboard, _add_serve_env, _add_serve_model):
        add(sub)
    _add_serve_tinker(sub)
    return parser


# models/families.py FAMILIES, named here so the parser builds without importing transformers (a test checks both).
TINY_FAMILIES = ("qwen3", "qwq", "deepseek-r1", "mistral", "gpt-oss", "granite")


def _add_tiny_model(sub: argparse._SubParsersAction) -> None:
    """``tiny-model``."""
    p = sub.add_parser(
        "tiny-model", help="build a tiny Llama (or, --preset qwen3-0.4b, a GPU-sized Qwen3) + its tokenizer (--family)"
    )
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="write over a model already at OUT_DIR")
    p.add_argument(
        "--preset",
        default="tiny",
        help="tiny: 0.8M-parameter Llama for CPU runs; qwen3-0.4b: Qwen3-0.6B's decoder (0.44B) for one GPU "
        "(models/tiny.py PRESETS)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="max_position_embeddings: prompt + answer tokens (e.g. 32768); default: the preset's (512, 4096)",
    )
    p.add_argument(
        "--family",
        default="char",
        help="tokenizer and chat template: char (default; one token per character, ChatML) or a real family's "
        f"template over a byte-level BPE: {', '.join(TINY_FAMILIES)} (models/families.py)",
    )
    p.set_defaults(fn=cmd_tiny_model)


def cmd_serve_gateway(args: argparse.Namespace) -> None:
    from areal_agents.config import load_config
    from areal_agents.config.gateway_service import ServeGatewayConfig

    cfg = load_config(ServeGatewayConfig, args.config, args.overrides)  # config errors before importing torch
    from areal_agents.rollout.gateway.serve import serve_gateway

    serve_gateway(cfg)


def _add_recipes(sub: argparse._SubParsersAction) -> None:
    """``train``, ``sft`` and ``serve-gateway``: a YAML config and ``key=value`` overrides."""
    from areal_agents.config import SFTConfig, TrainConfig
    from areal_agents.config.gateway_service import ServeGatewayConfig

    for name, fn, cls, text in (
        ("train", cmd_train, TrainConfig, "RL with decoupled PPO"),
        ("sft", cmd_sft, SFTConfig, "supervised fine-tuning on chat JSONL"),
        ("serve-gateway", cmd_serve_gateway, ServeGatewayConfig, "serve live traffic, keep rewarded sessions"),
    ):
        p = sub.add_parser(
            name,
            help=text,
            description=f"{text}. Config keys (set in the YAML file or as key=value):\n" + "\n".join(_config_help(cls)),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", default=[], help="key.sub=value overrides, e.g. ppo.lr=3e-4")
        p.set_defaults(fn=fn)
        if name == "serve-gateway":  # docs/gateway.md
            continue
        p.add_argument(
            "--no-progress", action="store_true", help="no progress output (a log file gets a progress line every 30 s)"
        )
        start = p.add_mutually_exclusive_group()  # a run_dir that holds a run needs one of them
        start.add_argument("--overwrite", action="store_true", help="remove run_dir's old run (checkpoints, ...) first")
        if name == "train":
            start.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in run_dir")
            p.add_argument(
                "--allow-config-change",
                action="store_true",
                help="--resume with changed model/env/rollout/ppo/engine/seed keys (listed when refused)",
            )


def _add_eval(sub: argparse._SubParsersAction) -> None:
    """``eval``: its options are `EvalOptions` keys, as flags (made from the fields), in ``--config`` or as
    ``key=value``."""
    from areal_agents.eval.options import EvalOptions, add_flags  # light: the dataclass, not the harness

    text = "evaluate a model: avg@n, pass@k, maj@k on AIME, MATH-500, LiveCodeBench, ... or any env"

    def description() -> str:
        keys = "\n".join(_config_help(EvalOptions))
        return f"{text}. Config keys (in --config, as key=value, or as the flags below; flags win):\n{keys}"

    p = sub.add_parser(
        "eval",
        help=text,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML file of these options (dataset: ..., env: {id, kwargs})")
    p.add_argument("overrides", nargs="*", default=[], help="overrides, e.g. n_samples=4 env.kwargs.max_turns=2")
    add_flags(p)
    p.add_argument("--overwrite", action="store_true", help="remove another eval's samples and summary from OUT first")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=cmd_eval)


def _add_tools(sub: argparse._SubParsersAction) -> None:
    """``eval-report``, ``plot``, ``trace``, ``export-lora``, ``datasets``, ``envs``."""
    p = sub.add_parser("eval-report", help="compare eval runs side by side")
    p.add_argument("runs", nargs="+", help="eval output directories (or their summary.json)")
    p.set_defaults(fn=cmd_eval_report)

    p = sub.add_parser("plot", help="PNG curves of a run (reward, accuracy, staleness, throughput)")
    p.add_argument("run_dir", help="a train run directory (with tensorboard/)")
    p.set_defaults(fn=cmd_plot)

    p = sub.add_parser("trace", help="a run's timeline as a Perfetto trace, and where its time went (the bound)")
    p.add_argument("run_dir", help="a train run directory (with timeline/)")
    p.add_argument("--out", help="where to write the trace (default: RUN/trace.json)")
    p.set_defaults(fn=cmd_trace)

    p = sub.add_parser("export-lora", help="a LoRA run's adapter, merged into its base (--merge) or alone (--adapter)")
    p.add_argument("run_dir", help="a train run directory (its newest checkpoint) or one checkpoint")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--merge", metavar="OUT", help="write base + adapter as one transformers checkpoint here")
    out.add_argument("--adapter", metavar="OUT", help="write PEFT's adapter directory here")
    p.add_argument("--policy", help="the agent whose adapter (a run with separate policies)")
    p.add_argument("--base", help="the base model's directory (default: the adapter config's)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    p.set_defaults(fn=cmd_export_lora)
    p = sub.add_parser("datasets", help="list the bundled datasets (names for --dataset and env kwargs)")
    p.set_defaults(fn=cmd_datasets)
    p = sub.add_parser("envs", help="list registered env ids with a one-line description")
    p.add_argument("--module", action="append", default=[], help="import this module first (registers ids)")
    p.add_argument("--all", action="store_true", help="include gymnasium's own envs")
    p.set_defaults(fn=cmd_envs)


def _add_dashboard(sub: argparse._SubParsersAction) -> None:
    """``dashboard``: live curves, the workers' timeline and a trajectory viewer of runs (docs/dashboard.md)."""
    p = sub.add_parser("dashboard", help="a local web page of runs: live curves, trajectories (docs/dashboard.md)")
    p.add_argument("runs", nargs="+", metavar="RUN", help="train run directories (several: side by side)")
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default: this machine only)")
    p.set_defaults(fn=cmd_dashboard)


def _add_serve_env(sub: argparse._SubParsersAction) -> None:
    """``serve-env``: the env-step HTTP server."""
    p = sub.add_parser(
        "serve-env",
        help="run the env-step HTTP server (docs/env-protocol.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument(
        "--mode",
        choices=["inline", "thread", "process"],
        default="thread",
        help="how env calls run: on the event loop, in threads, or in worker processes",
    )
    p.add_argument("--workers", type=int, default=4, help="threads or processes running env calls")
    p.add_argument("--step-timeout", type=float, default=60.0, help="seconds before a reset/step is a timeout")
    p.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle session expires")
    p.add_argument("--max-sessions", type=int, default=4096, help="open sessions before 429")
    p.add_argument("--max-action-chars", type=int, default=65536, help="longest accepted action")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest accepted request body")
    p.add_argument("--module", action="append", default=[], help="import this module first (registers ids)")
    p.add_argument(
        "--dataset",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a dataset clients may name (NAME=PATH, or a PATH or hub id named by itself); bundled sets always",
    )
    p.add_argument(
        "--data-dir", action="append", default=[], help="clients may name JSONL files under this folder (relative)"
    )
    p.set_defaults(fn=cmd_serve_env)

    p = sub.add_parser(
        "check-env-server",
        help="check a running env-step server, in any language, against the protocol (conformance suite)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8765")
    p.add_argument("--env-id", default="", help="the env to play (default: the first /v1/envs lists)")
    p.add_argument("--kwargs", default="{}", help="its kwargs, as a JSON object")
    p.add_argument(
        "--action",
        default="0",
        help="the action every step sends (over v2: every acting agent); episodes must end within --max-steps",
    )
    p.add_argument(
        "--multi-agent-env",
        default="",
        help="the multi-agent env the v2 checks play (default: areal_agents/Debate-v0 when /v1/envs lists it)",
    )
    p.add_argument("--multi-agent-kwargs", default="{}", help="its kwargs, as a JSON object")
    p.add_argument("--max-steps", type=int, default=64, help="steps an episode may take")
    p.add_argument("--session-probe-limit", type=int, default=256, help="fill the session cap when it is this or less")
    p.add_argument(
        "--strict",
        action="store_true",
        help="a check that could not run fails too (exit 1); a v1-only server's v2 checks do not: it conforms to v1",
    )
    p.set_defaults(fn=cmd_check_env_server)


def _add_serve_model(sub: argparse._SubParsersAction) -> None:
    """``serve-model``: a model over SGLang's native HTTP API on CPU."""
    from areal_agents.config import EngineOptions
    from areal_agents.config.flags import add_field_flag

    p = sub.add_parser(
        "serve-model",
        help="serve a model over SGLang's native HTTP API on CPU (docs/serve-model.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model-path", required=True, help="transformers checkpoint directory")
    p.add_argument("--tokenizer-path", default=None, help="default: the model path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--weight-version", default="default", help="the initial weight_version, as in SGLang")
    for f in dataclasses.fields(EngineOptions):  # the run's engine section has the same keys
        add_field_flag(p, EngineOptions, f.name, with_default=True)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="cpu", help="where the engine runs (cuda: in bfloat16)"
    )
    p.add_argument(
        "--tool-parser",
        default="auto",
        help="how /v1/chat/completions reads tool calls: hermes, mistral, deepseek, harmony, granite, none "
        "(auto: from the chat template)",
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        help="how /v1/chat/completions reads reasoning: think, harmony, none (auto: from the chat template)",
    )
    limits = p.add_argument_group("security and limits (docs/serve-model.md)")
    limits.add_argument(
        "--admin-key",
        help="control routes (pause, weights, adapters, weight groups) want 'Authorization: Bearer KEY' "
        "(default: $AREAL_ADMIN_KEY; unset: open to every client)",
    )
    for flag, default, text in (
        ("--max-n", 256, "samples one request asks for (/v1's n x prompts, a /generate batch)"),
        ("--max-body-bytes", 16 << 20, "largest request body (413)"),
        ("--max-json-values", 1 << 19, "JSON values a body may hold (bounds its parse)"),
        ("--max-lora-rank", 64, "largest LoRA rank /load_lora_adapter takes"),
        ("--max-loras", 8, "LoRA adapters held at once"),
    ):
        limits.add_argument(flag, type=int, default=default, help=text)
    p.set_defaults(fn=cmd_serve_model)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after flags: `train cfg.yaml --no-progress ppo.lr=1e-4`.
    args, extra = parser.parse_known_args(argv)
    unknown = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `module:Class` and env.module name files in the working directory
    try:
        return args.fn(args) or 0
    except ArealAgentsError as e:
        print(f"areal-agents {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"areal-agents {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
