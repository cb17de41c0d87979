"""Launching SGLang (and vLLM) servers from config, with a fake SGLang: SGLang itself cannot run here (no GPU),
so a fake ``sglang`` package behind a fake interpreter records the argv and CUDA_VISIBLE_DEVICES each
server got and answers /health; the launcher, its probe and its wait are the real ones."""

import json
import sys
from pathlib import Path

import pytest

from areal_agents.config import EngineConfig
from areal_agents.engines.local_servers import engine_dtype, launch_servers, server_command, server_gpus
from areal_agents.errors import ConfigError, EngineError

FAKE_LAUNCH_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

args = sys.argv[1:]
flag = lambda name: args[args.index(name) + 1]
record = {"argv": args, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
Path(os.environ["FAKE_SGLANG_RECORDS"], flag("--port") + ".json").write_text(json.dumps(record))


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


ThreadingHTTPServer((flag("--host"), int(flag("--port"))), Health).serve_forever()
"""


def fake_python(tmp_path: Path, with_sglang: bool = True) -> Path:
    """An interpreter (this one, wrapped) that imports a fake ``sglang`` whose launch_server records and serves."""
    package = tmp_path / "site" / "sglang"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    (tmp_path / "records").mkdir(exist_ok=True)
    path = "" if not with_sglang else f'export PYTHONPATH="{tmp_path / "site"}"\n'
    python = tmp_path / ("fake-python" if with_sglang else "python-without-sglang")
    records = f'export FAKE_SGLANG_RECORDS="{tmp_path / "records"}"\n'
    python.write_text(f'#!/bin/sh\n{path}{records}exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


def recorded(tmp_path: Path, address: str) -> tuple[dict[str, str], list[str], str | None]:
    """(flag -> value, argv, CUDA_VISIBLE_DEVICES) the fake server at ``address`` was started with."""
    record = json.loads((tmp_path / "records" / f"{address.rsplit(':', 1)[1]}.json").read_text())
    args = record["argv"]
    flags = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}
    return flags, args, record["CUDA_VISIBLE_DEVICES"]


@pytest.mark.process
def test_fake_sglang_gets_each_config_key_as_its_flag_and_its_own_gpus(tiny_dir, tmp_path):
    """engine.gpus=[6, 7, 4, 5], tp 2: server 0 sees GPUs 6,7 and server 1 sees 4,5, each from its GPU 0;
    dtype auto is bfloat16 though the checkpoint and model.dtype are float32; extra_args come last."""
    cfg = EngineConfig(
        backend="sglang", sglang_python=str(fake_python(tmp_path)), num_servers=2, tp=2, gpus=[6, 7, 4, 5],
        mem_fraction=0.6, extra_args=["--context-length", "2048"],
    )  # fmt: skip
    with launch_servers(cfg, str(tiny_dir), "float32", log_dir=tmp_path / "logs", supervise=False) as group:
        seen = [recorded(tmp_path, address) for address in group.addresses]
    for (flags, args, visible), gpus, address in zip(seen, ["6,7", "4,5"], group.addresses):
        assert args[:2] == ["--model-path", str(tiny_dir)] and visible == gpus
        assert flags["--port"] == address.rsplit(":", 1)[1] and flags["--host"] == "127.0.0.1"
        assert flags["--tp-size"] == "2" and flags["--mem-fraction-static"] == "0.6"
        assert flags["--dtype"] == "bfloat16" and flags["--base-gpu-id"] == "0"
        assert "--skip-server-warmup" in args and args[-2:] == ["--context-length", "2048"]


@pytest.mark.process
def test_colocated_sglang_servers_see_the_trainers_gpus_and_count_from_their_index(tiny_dir, tmp_path, monkeypatch):
    """No engine.gpus: CUDA_VISIBLE_DEVICES is the run's own; server i starts at GPU i x tp; dtype as set."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    cfg = EngineConfig(backend="sglang", sglang_python=str(fake_python(tmp_path)), num_servers=2, dtype="float16")
    with launch_servers(cfg, str(tiny_dir), "float32", log_dir=tmp_path / "logs", supervise=False) as group:
        seen = [recorded(tmp_path, address) for address in group.addresses]
    assert [visible for _, _, visible in seen] == ["3,5", "3,5"]
    assert [flags["--base-gpu-id"] for flags, _, _ in seen] == ["0", "1"]
    assert {flags["--dtype"] for flags, _, _ in seen} == {"float16"} and seen[0][0]["--tp-size"] == "1"
    restart = server_command(cfg, "/restart/dir", "float32", 1234, 1, tokenizer_path="/tok", weight_version="7")
    assert restart[:4] == [cfg.sglang_python, "-m", "sglang.launch_server", "--model-path"]
    assert restart[restart.index("--tokenizer-path") + 1] == "/tok" and restart[-1] == "7"


@pytest.mark.process
def test_an_interpreter_without_sglang_is_named_with_the_docs_before_any_server_starts(tiny_dir, tmp_path):
    without = EngineConfig(backend="sglang", sglang_python=str(fake_python(tmp_path, with_sglang=False)))
    with pytest.raises(EngineError, match=r"engine.sglang_python \(.*python-without-sglang\) has no sglang module"):
        launch_servers(without, str(tiny_dir), log_dir=tmp_path / "logs")
    assert not list((tmp_path / "logs").iterdir())
    with pytest.raises(EngineError, match=r"this interpreter \(engine.sglang_python is unset\).*docs/sglang.md"):
        server_command(EngineConfig(backend="sglang"), str(tiny_dir), "float32", 1, 0)  # .venv has no SGLang
    missing = EngineConfig(backend="sglang", sglang_python=str(tmp_path / "nope" / "python"))
    with pytest.raises(EngineError, match=r"engine.sglang_python: .*nope/python is not an executable file"):
        server_command(missing, str(tiny_dir), "float32", 1, 0)


def test_vllm_gets_tp_memory_dtype_extra_args_and_its_gpus(tiny_dir, tmp_path, monkeypatch):
    """The vLLM command builder (argv only: vLLM itself runs in test_remote_engines.py)."""
    monkeypatch.setattr("areal_agents.engines.local_servers.vllm_python", lambda cfg: "/venv-vllm/bin/python")
    cfg = EngineConfig(
        backend="vllm", num_servers=2, tp=2, gpus=[0, 1, 2, 3], mem_fraction=0.5, extra_args=["--enforce-eager"]
    )
    command = server_command(cfg, str(tiny_dir), "float32", 8000, 1, scratch=tmp_path)
    python = command.index("/venv-vllm/bin/python")
    env = dict(arg.split("=", 1) for arg in command[1:python])
    args = command[python:]
    flags = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}
    assert command[0] == "env" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert flags["--tensor-parallel-size"] == "2" and flags["--gpu-memory-utilization"] == "0.5"
    assert flags["--dtype"] == "bfloat16", "auto on GPUs: bfloat16, not the float32 checkpoint's"
    assert args[-1] == "--enforce-eager"


@pytest.mark.process
def test_fake_sglang_serves_adapters_up_to_max_lora_rank_when_it_is_set(tiny_dir, tmp_path):
    """engine.max_lora_rank 24, max_loras 2: --enable-lora, rank 24 (SGLang takes any), every module it can
    adapt (adapters come at run time: nothing to infer them from), 3 adapters a batch (SGLang counts the base
    model's requests as one); extra_args still last. max_lora_rank 0 (the default): no LoRA flag at all."""
    python = str(fake_python(tmp_path))
    cfg = EngineConfig(backend="sglang", sglang_python=python, max_lora_rank=24, max_loras=2, extra_args=["--x", "1"])
    with launch_servers(cfg, str(tiny_dir), "float32", log_dir=tmp_path / "logs", supervise=False) as group:
        flags, args, _ = recorded(tmp_path, group.addresses[0])
    assert "--enable-lora" in args and flags["--max-lora-rank"] == "24" and flags["--max-loras-per-batch"] == "3"
    assert flags["--lora-target-modules"] == "all" and args[-2:] == ["--x", "1"]
    plain = server_command(EngineConfig(backend="sglang", sglang_python=python), str(tiny_dir), "float32", 8000, 0)
    assert not any("lora" in a for a in plain)


@pytest.mark.parametrize("rank, flag", [(1, "1"), (8, "8"), (12, "16"), (64, "64"), (300, "320")])
def test_vllm_serves_adapters_at_the_next_rank_it_takes_with_runtime_updates_allowed(tiny_dir, tmp_path, monkeypatch,
                                                                                   rank, flag):  # fmt: skip
    """vLLM 0.32 takes --max-lora-rank from 1, 8, 16, 32, 64, 128, 256, 320, 512: a rank between goes up to the next;
    VLLM_ALLOW_RUNTIME_LORA_UPDATING opens /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    monkeypatch.setattr("areal_agents.engines.local_servers.vllm_python", lambda cfg: "/venv-vllm/bin/python")
    cfg = EngineConfig(backend="vllm", max_lora_rank=rank, max_loras=3)
    command = server_command(cfg, str(tiny_dir), "float32", 8000, 0, scratch=tmp_path)
    python = command.index("/venv-vllm/bin/python")
    env = dict(arg.split("=", 1) for arg in command[1:python])
    args = command[python:]
    flags = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and "--enable-lora" in args
    assert flags["--max-lora-rank"] == flag and flags["--max-loras"] == "3"
    plain = server_command(EngineConfig(backend="vllm"), str(tiny_dir), "float32", 8000, 0, scratch=tmp_path)
    assert not any("LORA" in a.upper() for a in plain)


def test_a_lora_rank_above_vllms_largest_is_refused_naming_the_key(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("areal_agents.engines.local_servers.vllm_python", lambda cfg: "/venv-vllm/bin/python")
    cfg = EngineConfig(backend="vllm", max_lora_rank=1024)
    with pytest.raises(ConfigError, match="engine.max_lora_rank: the server serves LoRA ranks up to 512, got 1024"):
        server_command(cfg, str(tiny_dir), "float32", 8000, 0, scratch=tmp_path)


@pytest.mark.parametrize(
    "backend, device, gpus, expected",
    [
        ("sglang", "auto", [], "bfloat16"),  # SGLang always runs on a GPU
        ("sglang", "cpu", [], "bfloat16"),  # ... whatever engine.device says (it is serve-model's)
        ("vllm", "cpu", [], "float16"),  # CPU: the checkpoint's own
        ("vllm", "auto", [0], "bfloat16"),  # engine.gpus names GPUs: a GPU
        ("serve-model", "cpu", [], "float32"),  # CPU: the run's model.dtype
        ("serve-model", "cuda", [], "bfloat16"),
        ("serve-model", "auto", [2], "bfloat16"),
    ],
)
def test_dtype_auto_is_bfloat16_on_a_gpu_and_as_before_on_cpu(tmp_path, backend, device, gpus, expected):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    cfg = EngineConfig(backend=backend, device=device, gpus=gpus)
    assert engine_dtype(cfg, str(tmp_path), "float32") == expected
    cfg = EngineConfig(backend=backend, device=device, gpus=gpus, dtype="float32")
    assert engine_dtype(cfg, str(tmp_path), "bfloat16") == "float32", "engine.dtype set: it, always"


def test_serve_model_servers_take_one_gpu_each_and_bad_gpu_lists_name_the_key(tiny_dir, tmp_path):
    cfg = EngineConfig(backend="serve-model", num_servers=2, tp=4, gpus=[1, 2])
    assert [server_gpus(cfg, i) for i in range(2)] == [[1], [2]]
    command = server_command(cfg, str(tiny_dir), "float32", 1, 1)
    assert command[:2] == ["env", "CUDA_VISIBLE_DEVICES=2"] and command[command.index("--dtype") + 1] == "bfloat16"
    sglang = EngineConfig(backend="sglang", num_servers=2, tp=2, gpus=[0, 1, 2])
    with pytest.raises(ConfigError, match=r"engine.gpus: expects .* = 2 x 2 = 4 GPU ids, got 3: \[0, 1, 2\]"):
        launch_servers(sglang, str(tiny_dir), log_dir=tmp_path / "logs")
    assert not list((tmp_path / "logs").iterdir()), "nothing started"
    with pytest.raises(ConfigError, match="engine.gpus: expects distinct GPU ids"):
        server_gpus(EngineConfig(backend="serve-model", num_servers=2, gpus=[3, 3]), 0)


@pytest.mark.process  # imports ray
def test_ray_server_actors_reserve_the_gpus_their_server_needs():
    """Under Ray the actor's reservation places the server (Ray sets its CUDA_VISIBLE_DEVICES)."""
    from areal_agents.cluster.engine_servers import check_server_gpus

    for backend, tp, gpus in [("sglang", 2, 2.0), ("sglang", 1, 0.5), ("vllm", 1, 0.0), ("serve-model", 4, 0.0)]:
        check_server_gpus(EngineConfig(backend=backend, tp=tp), gpus)
    with pytest.raises(ConfigError, match=r"ray.engine_server_gpus=0: each sglang server needs engine.tp=1 GPUs"):
        check_server_gpus(EngineConfig(backend="sglang"), 0.0)
    with pytest.raises(ConfigError, match=r"ray.engine_server_gpus=1: each vllm server needs engine.tp=2"):
        check_server_gpus(EngineConfig(backend="vllm", tp=2), 1.0)
    with pytest.raises(ConfigError, match=r"engine.gpus=\[0\]: places servers of a run without Ray"):
        check_server_gpus(EngineConfig(backend="sglang", gpus=[0]), 1.0)


def test_engine_device_reaches_serve_model_and_the_in_process_engine(tiny_dir, tmp_path):
    """engine.device: serve-model's --device (parsed by its own parser) and HFEngine's device."""
    import torch

    from areal_agents.cli import build_parser
    from areal_agents.engines.local_servers import open_engine

    for device in ("cpu", "cuda"):
        command = server_command(EngineConfig(backend="serve-model", device=device), "m", "float32", 1, 0)
        assert build_parser().parse_args(command[command.index("serve-model") :]).device == device
    engine, servers = open_engine(EngineConfig(device="cpu"), str(tiny_dir), "float32", run_dir=tmp_path)
    assert servers is None and engine.placement.device == torch.device("cpu")
    if torch.cuda.is_available():  # the device machine: the engine goes there
        engine, _ = open_engine(EngineConfig(device="cuda"), str(tiny_dir), "float32", run_dir=tmp_path)
        assert engine.placement.device.type == "cuda"
    else:  # here: the device reached the engine, which refuses a GPU torch does not see
        with pytest.raises(ConfigError, match="device: cuda asked for, but torch sees no GPU"):
            open_engine(EngineConfig(device="cuda"), str(tiny_dir), "float32", run_dir=tmp_path)


@pytest.mark.slow
def test_ray_gives_each_sglang_actor_its_gpus_and_the_server_counts_from_zero(tmp_path):
    """launcher=ray: a local cluster declaring 2 GPUs (none exist here; Ray hands out their ids all the
    same), two tp-1 SGLang actors reserving one each: Ray's CUDA_VISIBLE_DEVICES reaches each server."""
    import ray

    from areal_agents.cluster.engine_servers import EngineServers

    cfg = EngineConfig(backend="sglang", sglang_python=str(fake_python(tmp_path)), num_servers=2)
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        servers = EngineServers(cfg, "/models/m", "float32", tmp_path / "servers", cpus=0.5, gpus=1.0)
        try:
            seen = [recorded(tmp_path, address) for address in servers.addresses]
        finally:
            servers.stop()
    finally:
        ray.shutdown()
    assert sorted(visible for _, _, visible in seen) == ["0", "1"]
    assert {flags["--base-gpu-id"] for flags, _, _ in seen} == {"0"}
    assert {flags["--dtype"] for flags, _, _ in seen} == {"bfloat16"}
