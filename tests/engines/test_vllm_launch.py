"""The vLLM backend without a server: the launch command, the errors before a start, the reply reader and
the checks on weights vLLM would reload wrongly (the real server: test_remote_engines.py)."""

import json
import os
import sys
from pathlib import Path

import pytest

from areal_agents.config import EngineConfig, TrainConfig, load_config
from areal_agents.engines.local_servers import engine_client, engine_dtype, launch_servers, server_command
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.engines.vllm.client import VLLMEngine, check_reloadable, read_generate_reply
from areal_agents.engines.weight_sync import write_weights
from areal_agents.errors import ConfigError, EngineError
from areal_agents.models import load_model

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("AREAL_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")

# A reply of vLLM 0.32.0's /inference/v1/generate, recorded from the tiny model (logprobs shortened to 3).
RECORDED = {
    "request_id": "generate-tokens-ep1/t0#ab",
    "choices": [
        {
            "index": 0,
            "finish_reason": "abort",
            "stop_reason": None,
            "token_ids": [14, 14, 9],
            "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
            "logprobs": {
                "content": [
                    {"token_id": 14, "logprob": -3.9189, "rank": 1, "top_logprobs": []},
                    {"token_id": 14, "logprob": -3.4537, "rank": 1, "top_logprobs": []},
                    {"token_id": 9, "logprob": -3.4745, "rank": 2, "top_logprobs": []},
                ]
            },
        }
    ],
}


def vllm_config(**kw) -> EngineConfig:
    """A CPU vLLM server's config (device cpu: a machine whose torch sees a GPU would pick bfloat16)."""
    return EngineConfig(backend="vllm", vllm_python=sys.executable, device="cpu", **kw)


def test_the_command_names_the_flags_the_client_needs_and_keeps_its_files_in_scratch(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("areal_agents.engines.local_servers.vllm_python", lambda cfg: "/venv/bin/python")
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    cfg = vllm_config(max_model_len=1024, tp=2, extra_args=["--enforce-eager"])
    command = server_command(cfg, str(tiny_dir), "bfloat16", 8123, 0, tokenizer_path="/tok", scratch=tmp_path)
    env = dict(arg.split("=", 1) for arg in command[1 : command.index("/venv/bin/python")])
    args = command[command.index("/venv/bin/python") :]
    assert command[0] == "env" and env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["TMPDIR"] == str(tmp_path) and env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")
    assert args[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}
    assert flags["--model"] == str(tiny_dir) and flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["--dtype"] == "float32", "auto: the checkpoint's own dtype, not the run's model.dtype"
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--tensor-parallel-size"] == "2"
    assert flags["--max-model-len"] == "1024" and flags["--tokenizer"] == "/tok"
    assert "--enable-scale-out" in args and args[-1] == "--enforce-eager"
    with pytest.raises(EngineError, match="scratch directory"):
        server_command(cfg, str(tiny_dir), "float32", 8123, 0)


def test_engine_dtype_auto_is_the_checkpoints_for_vllm_and_the_runs_for_serve_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert engine_dtype(vllm_config(), str(tmp_path), "float32") == "bfloat16"
    assert engine_dtype(EngineConfig(backend="sglang"), str(tmp_path), "float32") == "bfloat16"
    assert engine_dtype(EngineConfig(backend="serve-model", device="cpu"), str(tmp_path), "float32") == "float32"
    assert engine_dtype(vllm_config(dtype="float16"), str(tmp_path), "float32") == "float16"


@pytest.mark.process
def test_an_interpreter_without_vllm_is_named_with_the_command_that_builds_one(tiny_dir, tmp_path):
    with pytest.raises(EngineError, match=r"has no vllm module; bash scripts/setup.sh --with-vllm"):
        server_command(vllm_config(), str(tiny_dir), "float32", 8123, 0, scratch=tmp_path)  # .venv has no vLLM
    missing = EngineConfig(backend="vllm", vllm_python=str(tmp_path / "nope" / "python"))
    with pytest.raises(EngineError, match=r"engine.vllm_python: .*nope/python is not an executable file"):
        server_command(missing, str(tiny_dir), "float32", 8123, 0, scratch=tmp_path)


def test_the_config_picks_the_client_and_refuses_keep_for_the_in_process_engine():
    assert type(engine_client(vllm_config(), ["http://h:1"])) is VLLMEngine
    client = engine_client(EngineConfig(backend="serve-model", pause_mode="keep"), ["http://h:1"])
    assert type(client) is SGLangEngine and client.pause_mode == "keep"
    with pytest.raises(ConfigError, match="pause_mode"):
        load_config(TrainConfig, None, ["engine.pause_mode=keep"])
    with pytest.raises(ConfigError, match="engine.backend"):
        load_config(TrainConfig, None, ["engine.backend=vlm"])


def test_a_recorded_reply_gives_tokens_logprobs_and_each_tokens_version():
    part = read_generate_reply(RECORDED)
    assert part.tokens == [14, 14, 9] and part.finish == "abort"
    assert part.logprobs == [-3.9189, -3.4537, -3.4745] and part.versions == ["3", "3", "4"]
    engine = VLLMEngine(["http://h:1"])
    engine._names.update({"3": 3, "4": 4})
    assert [engine._to_int(v, 0) for v in part.versions] == [3, 3, 4]


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda r: r["choices"][0].update(finish_reason="error"), "finish_reason 'error'"),
        (lambda r: r["choices"][0]["logprobs"]["content"].pop(), "3 token_ids but 2 logprobs"),
        (lambda r: r.pop("choices"), "missing or bad 'choices'"),
        (lambda r: r["choices"][0].pop("weight_versions"), "weight_versions covers 0 of 3 tokens"),
    ],
)
def test_a_reply_without_what_the_client_needs_is_an_error_naming_it(change, error):
    reply = json.loads(json.dumps(RECORDED))
    change(reply)
    with pytest.raises((ValueError, EngineError), match=error):
        read_generate_reply(reply)


def test_weights_vllm_would_reload_wrongly_are_refused_before_a_server_sees_them(tiny_dir, tmp_path):
    with pytest.raises(EngineError, match="holds no \\*.safetensors"):
        check_reloadable(tmp_path)
    model = load_model(tiny_dir)
    model.save_pretrained(tmp_path / "tied")  # ties lm_head to the embeddings and leaves it out
    with pytest.raises(EngineError, match="no lm_head.weight"):
        check_reloadable(tmp_path / "tied")
    write_weights(model.state_dict(), tmp_path / "pushed")
    check_reloadable(Path(tmp_path / "pushed"))


@pytest.mark.slow
@pytest.mark.vllm
def test_a_vllm_server_that_dies_at_start_fails_the_launch_with_its_log_tail(tiny_dir, tmp_path):
    if not Path(VLLM_PYTHON).is_file():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: bash scripts/setup.sh --with-vllm")
    cfg = EngineConfig(backend="vllm", vllm_python=VLLM_PYTHON, extra_args=["--no-such-flag"])
    with pytest.raises(EngineError, match=r"(?s)exited with code \d+ during start-up.*--no-such-flag"):
        launch_servers(cfg, str(tiny_dir), log_dir=tmp_path / "logs", supervise=False)
