"""The README keeps its promises: the sections it has, its size, no path outside the repo, and every CPU
command it shows runs as written.

The slow test runs README.md's shell blocks line by line from the repo root, in order (the quickstart
first), and its Python blocks as one session after them; it skips the lines marked ``# GPU``,
``# SGLang``, ``# e2b`` or ``# multi-node`` and ``bash scripts/test.sh`` (which is what runs it). Blocks
that start with ``# file: NAME`` are saved to a scratch folder on ``PYTHONPATH``, as a reader saves them
beside their shell. Servers (``serve-env``, ``serve-model``) count as running when ``/health`` answers;
they are stopped then. A ``text`` block right after a shell block is that block's expected output: each
of its lines (``...`` skips) must appear in order, any number in it standing for any number.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
MARKED = re.compile(r"\s#\s*(GPU|SGLang|e2b|multi-node)\b")
ITSELF = "bash scripts/test.sh"
SERVER = re.compile(r"^areal-agents (serve-env|serve-model)\b")
NUMBER = r"[+-]?\d[\d,]*(?:\.\d+)?"
SECTIONS = (
    "## Install and first run",
    "## Core concepts",
    "## Command line",
    "## Data",
    "## Measured",
    "## Status and limits",
    "## Documentation",
)
CONCEPTS = ("**Environment.**", "**Engine.**", "**Agent.**", "**Rollout controller.**", "**Trainer.**")


def blocks(text: str) -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in FENCE.findall(text)]


def command_lines(body: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    lines, pending = [], ""
    for raw in body.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def runnable(line: str) -> bool:
    return not MARKED.search(line) and not line.startswith(ITSELF)


def shape(expected: str) -> re.Pattern:
    """An expected output line as a pattern: numbers may differ, and so may runs of spaces."""
    parts = []
    for k, piece in enumerate(re.split(f"({NUMBER})", expected.strip())):
        if k % 2:
            parts.append(NUMBER)
        else:
            parts += [r"\s+" if w.isspace() else re.escape(w) for w in re.split(r"(\s+)", piece) if w]
    return re.compile("".join(parts))


def assert_shows(expected: str, output: str, what: str) -> None:
    lines, at = output.splitlines(), 0
    for want in expected.splitlines():
        if not want.strip() or want.strip() == "...":
            continue
        pattern = shape(want)
        while at < len(lines) and not pattern.search(lines[at]):
            at += 1
        assert at < len(lines), f"{what}: expected a line like {want!r} (in order); output tail:\n{output[-3000:]}"
        at += 1


# ---- fast: what the README promises on its face ----------------------------------------------------------


def test_readme_has_the_promised_sections_and_size():
    text = README.read_text()
    for heading in SECTIONS:
        assert f"\n{heading}\n" in text, f"README.md lacks the section {heading!r}"
    starts = [text.find(concept) for concept in CONCEPTS]
    for concept, start, end in zip(CONCEPTS, starts, [*starts[1:], text.find("\n## Command line")]):
        assert 0 <= start < end, f"README.md lacks the concept {concept} (in this order, before the CLI)"
        assert "```python" in text[start:end], f"the concept {concept} has no snippet"
    assert len(text.splitlines()) <= 300, f"README.md has {len(text.splitlines())} lines; at most ~300"
    outside = "../" + "shared"  # spelt so, since tests/test_self_contained.py rejects the literal everywhere
    assert outside not in text and "shared/" not in text, "README.md points at a folder outside the repo"
    langs = [lang for lang, _ in blocks(text)]
    assert langs.count("bash") >= 3 and langs.count("python") >= 5 and "text" in langs


def test_readme_names_every_cli_command_in_its_table():
    from areal_agents.cli import build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]  # noqa: SLF001
    table = set(re.findall(r"^\| `areal-agents ([a-z-]+)", README.read_text(), re.MULTILINE))
    assert table == set(sub.choices), f"README table {sorted(table)} vs CLI {sorted(sub.choices)}"


def test_readme_marks_what_needs_a_gpu_a_cluster_or_a_cloud():
    needs = {
        r"engine\.backend=sglang|--engine sglang|\[sglang\]": "SGLang",
        r"ray\.address=": "multi-node",
        r"E2B_API_KEY": "e2b",
    }
    for lang, body in blocks(README.read_text()):
        if lang != "bash":
            continue
        for line in command_lines(body):
            for pattern, marker in needs.items():
                if re.search(pattern, line):
                    assert MARKED.search(line), f"README line needs a '# {marker}' marker: {line}"


def test_readme_python_blocks_compile_and_links_resolve():
    import ast

    text = README.read_text()
    for k, (lang, body) in enumerate(blocks(text)):
        if lang == "python":
            compile(body, f"README python block {k}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for target in re.findall(r"\]\(((?:docs|examples)/[^)#]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).is_file(), f"README links to a missing file: {target}"
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", (ROOT / "docs" / "benchmarks.md").read_text(), re.MULTILINE)
    }
    for anchor in re.findall(r"\]\(docs/benchmarks\.md#([^)]+)\)", text):
        assert anchor in headings, f"README links to a missing heading of docs/benchmarks.md: #{anchor}"


def _readme_imports() -> str:
    python = "\n".join(body for lang, body in blocks(README.read_text()) if lang == "python")
    return "\n".join(line for line in python.splitlines() if re.match(r"(from \S+ )?import ", line))


@pytest.mark.process
def test_readme_imports_only_current_paths():
    """Fast twin of the slow session's check: importing what the README imports warns of no moved path."""
    imports = _readme_imports()
    assert "from areal_agents" in imports, imports
    done = subprocess.run(
        [sys.executable, "-c", _SESSION], input=imports, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"README imports raise a DeprecationWarning:\n{done.stderr[-3000:]}"


@pytest.mark.process
def test_the_session_fails_on_an_old_module_path():
    done = subprocess.run(
        [sys.executable, "-c", _SESSION],
        input="from areal_agents.trainers.setup import make_optimizer",
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "areal_agents.trainers.setup moved to" in done.stderr, done.stderr


def test_the_expected_output_matcher():
    want = "held-out greedy accuracy (200 problems): after SFT 70.0% -> after RL 88.5% (+18.5 points)"
    got = "noise\nheld-out greedy accuracy (200 problems): after SFT 66.5% -> after RL  91.0% (+24.5 points)\n"
    assert_shows(f"...\n{want}", got, "matcher")
    with pytest.raises(AssertionError):
        assert_shows(want, got.replace("after RL", "after SFT"), "matcher")
    assert command_lines("a \\\n  b  # c\n# d\n\ne\n") == ["a b  # c", "e"]
    assert not runnable("pip install -e .   # GPU") and not runnable("bash scripts/test.sh  # all") and runnable("ls")


# ---- slow: run it all ------------------------------------------------------------------------------------


def _serve(line: str, env: dict[str, str]) -> None:
    port = re.search(r"--port[ =](\d+)", line)
    assert port, f"a server line needs --port for the test to reach it: {line}"
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {line}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"server exited ({proc.returncode}): {line}\n{proc.stdout.read()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"server did not answer /health within 180 s: {line}"
            time.sleep(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The README's Python runs as one session that fails on a DeprecationWarning a README line raised: one
# attributed to a README line, or one of ours (an old module path the README imports).
_SESSION = r"""
import ast, asyncio, sys, warnings
NAME = "README python blocks"
code = compile(sys.stdin.read(), NAME, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = eval(code, {"__name__": "__main__"})
    if result is not None:
        asyncio.run(result)
ours = [w for w in caught if issubclass(w.category, DeprecationWarning)]
ours = [w for w in ours if w.filename == NAME or str(w.message).startswith("areal_agents.")]
for w in ours:
    print(f"README DeprecationWarning: {w.filename}:{w.lineno}: {w.message}", file=sys.stderr)
sys.exit(1 if ours else 0)
"""


@pytest.mark.slow
def test_every_cpu_command_in_the_readme_runs(tmp_path):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p),
    }
    items = blocks(README.read_text())
    python: list[str] = []

    def run_python() -> None:
        if python:
            done = subprocess.run(
                [sys.executable, "-c", _SESSION],
                input="\n".join(python),
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert done.returncode == 0, f"README python blocks failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
            python.clear()

    ran = 0
    for k, (lang, body) in enumerate(items):
        first = body.splitlines()[0] if body.strip() else ""
        if first.startswith("# file: "):
            (tmp_path / first.removeprefix("# file: ").strip()).write_text(body)
        elif lang == "python":
            python.append(body)
        elif lang == "bash":
            run_python()
            output = ""
            for line in filter(runnable, command_lines(body)):
                ran += 1
                if SERVER.match(line):
                    _serve(line, env)
                    continue
                done = subprocess.run(
                    ["bash", "-c", line],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=1800,
                )
                assert done.returncode == 0, f"README command failed ({done.returncode}): {line}\n{done.stdout[-5000:]}"
                output += done.stdout
            following = items[k + 1] if k + 1 < len(items) else ("", "")
            if following[0] == "text":
                assert_shows(following[1], output, f"README block {k}")
            accuracy = re.search(r"after SFT ([\d.]+)% -> after RL ([\d.]+)%", output)
            if accuracy:  # the quickstart visibly improves: about 70% -> 88% in the README
                sft, rl = map(float, accuracy.groups())
                assert rl >= sft + 8, f"the quickstart's RL gained too little: {sft}% -> {rl}%"
    run_python()
    assert ran >= 10, f"only {ran} README commands ran"
