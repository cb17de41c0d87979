"""The tutorial's code blocks run as written, in order, in an empty directory (docs cannot rot)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def blocks(doc: Path) -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in FENCE.findall(doc.read_text())]


def test_the_tutorial_has_the_blocks_it_promises():
    langs = [lang for lang, _ in blocks(DOCS / "custom-env-and-agent.md")]
    assert langs.count("python") >= 4 and "yaml" in langs and langs.count("bash") >= 3


@pytest.mark.slow
def test_custom_env_and_agent_tutorial_runs(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for k, (lang, body) in enumerate(blocks(DOCS / "custom-env-and-agent.md")):
        first = body.splitlines()[0]
        if first.startswith("# file: "):
            (tmp_path / first.removeprefix("# file: ").strip()).write_text(body)
            continue
        if lang == "python":
            cmd = [sys.executable, "-"]
        elif lang == "bash":
            cmd = ["bash", "-e", "-"]
        else:
            raise AssertionError(f"block {k} ({lang}) is neither a file nor runnable")
        done = subprocess.run(cmd, input=body, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"block {k} failed:\n{body}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert (tmp_path / "runs" / "repeat" / "summary.json").is_file()
    assert (tmp_path / "runs" / "repeat_fn" / "summary.json").is_file()
    assert (tmp_path / "runs" / "repeat_proc" / "summary.json").is_file()
