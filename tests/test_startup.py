"""Start-up (issue 43): listings, help and one-line config errors import none of the heavy libraries (torch,
transformers, the model servers' and the reward's dependencies), and env descriptions are plain text."""

import json
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

from areal_agents.cli import main
from areal_agents.envs.registry import plain_text

ROOT = Path(__file__).resolve().parents[1]

# Seconds to import each (on 2 cores: torch ~3, transformers ~2, openai ~1); none is needed to list or to refuse.
HEAVY = (
    "torch",
    "transformers",
    "datasets",
    "safetensors",
    "tokenizers",
    "peft",
    "math_verify",
    "sympy",
    "openai",
    "fastapi",
    "uvicorn",
    "pydantic",
    "aiohttp",
    "httpx",
    "ray",
    "matplotlib",
    "tensorboard",
)

# Each command runs in one fresh interpreter, in turn; after each, the heavy modules it imported are listed.
PROBE = """
import contextlib, io, json, sys
from areal_agents.cli import main
heavy, seen = set(json.loads(sys.argv[1])), {}
for argv in json.loads(sys.argv[2]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # --help
            code = e.code
    seen[" ".join(argv)] = [code, sorted({m.split(".")[0] for m in sys.modules} & heavy)]
print(json.dumps(seen))
"""

COMMANDS = {
    "--help": 0,
    "envs": 0,
    "datasets": 0,
    "train --help": 0,
    "sft --help": 0,
    "train missing.yaml": 2,
    "train examples/arithmetic/rl.yaml steps=abc": 2,
    "train examples/arithmetic/rl.yaml no_such_key=1": 2,
}


@pytest.mark.process
def test_listings_help_and_config_errors_import_no_heavy_library(tmp_path):
    held = tmp_path / "held"  # a run_dir that holds a run: refused (no --resume or --overwrite) before torch
    (held / "checkpoints" / "step_2").mkdir(parents=True)
    (held / "config.json").write_text("{}")
    commands = {**COMMANDS, f"train examples/arithmetic/rl.yaml run_dir={held}": 2}
    argvs = [c.split() for c in commands]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(HEAVY), json.dumps(argvs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert {command: code for command, (code, _) in seen.items()} == commands
    assert {command: heavy for command, (_, heavy) in seen.items() if heavy} == {}


@pytest.mark.process
def test_importing_the_package_or_any_builtin_env_imports_no_heavy_library():
    modules = ["areal_agents.envs." + m for m in ("arithmetic", "count", "math", "code", "debate", "tools")]
    probe = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)) & set(HEAVY) == set()


def test_importing_the_package_still_registers_the_builtin_ids():
    import areal_agents  # noqa: F401

    for env_id in ("Arithmetic", "Count", "Math", "Code", "Debate"):
        assert f"areal_agents/{env_id}-v0" in gym.registry
    env = gym.make("areal_agents/Arithmetic-v0")
    obs, _ = env.reset(seed=0)
    assert isinstance(obs, str) and obs


def test_eval_help_still_lists_its_config_keys(capsys):
    # The one help whose text needs the eval harness: it is built when shown, not when the parser is.
    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Config keys" in out and "n_samples = " in out and "--dataset" in out


@pytest.mark.parametrize(
    ("marked", "plain"),
    [
        ("Answer ``a op b =`` with the exact integer.", "Answer a op b = with the exact integer."),
        ("A :class:`~areal_agents.envs.base.TextEnv` made by :func:`make_env`.", "A TextEnv made by make_env."),
        ("Reward by `verify_math`; see `the docs <https://example.org>`_.", "Reward by verify_math; see the docs."),
        ("*One* agent, **two** turns (agents ``debater_0..N-1``).", "One agent, two turns (agents debater_0..N-1)."),
        # not markup: products, powers, *args, a lone star, snake_case
        ("a * b * c, 2*3*4, x**2, f(*args), snake_case_name", "a * b * c, 2*3*4, x**2, f(*args), snake_case_name"),
    ],
)
def test_plain_text_strips_rest_inline_markup(marked, plain):
    assert plain_text(marked) == plain


def test_envs_lists_plain_text_descriptions(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    # the id column is as wide as the longest registered id (other tests in this process register more)
    assert re.search(r"^areal_agents/Arithmetic-v0 +Answer a op b = with the exact integer", out, re.MULTILINE), out
    assert "``" not in out and ":class:" not in out and "`" not in out
