"""The protocol is language-neutral: a Java client plays an episode against a real server."""

import shutil
import subprocess
from pathlib import Path

import pytest

from areal_agents.envs import make_env
from areal_agents.envs.runtime.remote import EnvServerProcess

CLIENT = Path(__file__).parents[2] / "examples" / "clients" / "java" / "EnvClient.java"


@pytest.mark.skipif(shutil.which("javac") is None, reason="javac (a JDK) is not installed")
def test_java_client_plays_an_episode(tmp_path):
    subprocess.run(["javac", "-d", str(tmp_path), str(CLIENT)], check=True, capture_output=True)
    problem = make_env("areal_agents/Arithmetic-v0", digits=3).reset(seed=7)[0]
    with EnvServerProcess() as server:
        out = subprocess.run(
            ["java", "-cp", str(tmp_path), "EnvClient", server.url, "7"], capture_output=True, text=True, timeout=60
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(f"problem {problem} answer ")
    assert "reward 1.0 terminated true" in out.stdout
