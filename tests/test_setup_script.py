"""The setup and CI scripts: how scripts/setup.sh chooses a torch, and CI's rule that a skip is a failure."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"
UNREACHABLE = "http://127.0.0.1:9/simple"  # the discard port: nothing listens, the connection is refused


def fake_venv(tmp_path: Path, torch_importable: bool, cpu_index_works: bool) -> Path:
    """A venv whose python answers `import torch` as told and whose pip logs its arguments."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f"#!/bin/sh\nexit {0 if torch_importable else 1}\n")
    fail = "" if cpu_index_works else 'case "$*" in *--index-url*) exit 1;; esac\n'
    (venv / "bin" / "pip").write_text(f'#!/bin/sh\necho "$*" >> "{tmp_path}/pip.log"\n{fail}exit 0\n')
    for f in ("python", "pip"):
        (venv / "bin" / f).chmod(0o755)
    return venv


def run_setup_fn(tmp_path: Path, venv: Path, fn: str, gpu: bool) -> subprocess.CompletedProcess:
    """Source setup.sh and call ``fn`` with a PATH that has (or lacks) an nvidia-smi."""
    bin_dir = tmp_path / "path"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("grep", "cat", "sh", "env", "mktemp", "rm"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {
        "PATH": str(bin_dir),
        "VENV": str(venv),
        "TORCH_CPU_INDEX": UNREACHABLE,
        "NVIDIA_PROC": str(tmp_path / "no-such-driver"),  # the GPU machine this may run on must not count
    }
    bash = shutil.which("bash")
    return subprocess.run([bash, "-c", f'source "{SETUP}"; {fn}'], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "torch_importable, gpu, plan",
    [(True, False, "keep"), (True, True, "keep"), (False, False, "cpu-index"), (False, True, "default")],
)
def test_torch_plan(tmp_path, torch_importable, gpu, plan):
    venv = fake_venv(tmp_path, torch_importable, cpu_index_works=True)
    out = run_setup_fn(tmp_path, venv, "torch_plan", gpu)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == plan


def pip_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


def test_cpu_machine_takes_pytorchs_cpu_index(tmp_path):
    venv = fake_venv(tmp_path, torch_importable=False, cpu_index_works=True)
    out = run_setup_fn(tmp_path, venv, "install_torch", gpu=False)
    assert out.returncode == 0, out.stderr
    (call,) = pip_calls(tmp_path)
    assert f"--index-url {UNREACHABLE} --timeout 10 --retries 0 torch==" in call


def test_unreachable_cpu_index_falls_back_to_the_default_index(tmp_path):
    venv = fake_venv(tmp_path, torch_importable=False, cpu_index_works=False)
    out = run_setup_fn(tmp_path, venv, "install_torch", gpu=False)
    assert out.returncode == 0, out.stderr
    first, second = pip_calls(tmp_path)
    assert "--index-url" in first
    assert "--index-url" not in second and "torch==" in second
    assert "CPU index" in out.stderr


def fake_reporting_venv(tmp_path: Path, cpu_index_works: bool, wheel: str, describe: str) -> Path:
    """`fake_venv` whose pip writes a --report naming ``wheel`` and whose python describes torch as ``describe``."""
    venv = fake_venv(tmp_path, torch_importable=False, cpu_index_works=cpu_index_works)
    report = f'{{"install": [{{"metadata": {{"name": "torch"}}, "download_info": {{"url": "{wheel}"}}}}]}}'
    pip = (
        (venv / "bin" / "pip")
        .read_text()
        .replace(
            "exit 0\n", f'for a in "$@"; do [ "$prev" = --report ] && echo \'{report}\' > "$a"; prev=$a; done\nexit 0\n'
        )
    )
    (venv / "bin" / "pip").write_text(pip)
    (venv / "bin" / "python").write_text(
        f'#!/bin/sh\n[ "$1" = - ] && exec {sys.executable} "$@"\n'
        f'case "$2" in *torch.version.cuda*) echo "{describe}"; exit 0;; esac\nexit 1\n'
    )
    return venv


def test_setup_names_the_source_that_served_torch(tmp_path):
    """pip asked PyTorch's CPU index, but a find-links folder of pip's configuration served the wheel: setup
    says so rather than crediting the index."""
    local = "file:///opt/wheels/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl"
    out = run_setup_fn(tmp_path, fake_reporting_venv(tmp_path, True, local, "2.13.0+cpu "), "install_torch", gpu=False)
    assert f"setup: torch 2.13.0+cpu from {local}: pip's own configuration (find-links" in out.stdout, out.stdout
    index = "https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl"
    venv = fake_reporting_venv(tmp_path / "index", True, index, "2.13.0+cpu ")
    out = run_setup_fn(
        tmp_path / "index", venv, "TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu install_torch", False
    )
    assert f"from {index}: PyTorch's CPU index: the CPU build" in out.stdout, out.stdout


def test_setup_says_where_torch_came_from_and_why(tmp_path):
    """The CPU index was unreachable and pip's configuration served torch (here: a local wheel folder): setup
    names the wheel pip installed (from pip's --report) and the reason; a CUDA build on a CPU machine warns."""
    wheel = "file:///opt/wheels/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl"
    out = run_setup_fn(tmp_path, fake_reporting_venv(tmp_path, False, wheel, "2.13.0+cpu "), "install_torch", False)
    assert out.returncode == 0, out.stderr
    assert (
        f"setup: torch 2.13.0+cpu from {wheel}: the default index of pip's configuration, as PyTorch's CPU index"
        in (out.stdout)
    ), out.stdout
    assert "unreachable" in out.stdout and "warning" not in out.stderr
    venv = fake_reporting_venv(tmp_path / "cuda", False, wheel, "2.13.0 12.8")  # a CUDA build on this CPU machine
    out = run_setup_fn(tmp_path / "cuda", venv, "install_torch", gpu=False)
    assert (
        "setup: torch 2.13.0 from" in out.stdout and "CUDA 12.8 build on a machine without an NVIDIA GPU" in out.stderr
    )


def test_gpu_machine_takes_the_default_index_and_a_kept_torch_installs_nothing(tmp_path):
    venv = fake_venv(tmp_path, torch_importable=False, cpu_index_works=True)
    out = run_setup_fn(tmp_path, venv, "install_torch", gpu=True)
    assert out.returncode == 0, out.stderr
    (call,) = pip_calls(tmp_path)
    assert "--index-url" not in call and "torch==" in call
    (tmp_path / "pip.log").unlink()
    venv = fake_venv(tmp_path / "kept", torch_importable=True, cpu_index_works=True)
    assert run_setup_fn(tmp_path, venv, "install_torch", gpu=False).returncode == 0
    assert pip_calls(tmp_path) == [] and pip_calls(tmp_path / "kept") == []


def test_with_sglang_installs_sglang_into_its_own_env_on_a_gpu_machine_only(tmp_path):
    """SGLang's pins clash with ours: it goes into an environment of its own, never into .venv; on a machine
    without an NVIDIA GPU (no CPU build on PyPI) setup refuses before installing anything."""
    venv = fake_venv(tmp_path, torch_importable=True, cpu_index_works=True)  # .venv: must stay untouched
    sglang_venv = fake_venv(tmp_path / "sglang", torch_importable=False, cpu_index_works=True)  # no sglang yet
    out = run_setup_fn(tmp_path, venv, f'SGLANG_VENV="{sglang_venv}" install_sglang python3', gpu=True)
    assert out.returncode == 0, out.stderr
    assert pip_calls(tmp_path) == [] and pip_calls(tmp_path / "sglang") == [
        "install --quiet --disable-pip-version-check sglang==0.5.23"
    ]
    assert f"engine.sglang_python={sglang_venv}/bin/python" in out.stdout
    cpu_machine = tmp_path / "cpu"  # a PATH of its own: without the nvidia-smi above
    cpu_machine.mkdir()
    for fn in (f'SGLANG_VENV="{sglang_venv}" install_sglang python3', "main --with-sglang"):
        out = run_setup_fn(cpu_machine, venv, fn, gpu=False)
        assert out.returncode == 2 and "--with-sglang needs an NVIDIA GPU" in out.stderr, out.stderr
    assert len(pip_calls(tmp_path / "sglang")) == 1 and pip_calls(tmp_path) == []


def test_pip_fails_fast_on_an_unreachable_index(tmp_path):
    """The flags setup.sh gives pip for PyTorch's index make a real pip give up at once, not hang."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # only the unreachable index: no local wheel folders, no mirrors
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(tmp_path), "torch==2.13.0"]
        + ["--index-url", UNREACHABLE, "--timeout", "10", "--retries", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert time.monotonic() - start < 30


CI_TESTS = {
    "test_a.py": """
import pytest

def test_runs():
    pass

def test_skips_at_run_time():
    pytest.skip("no widget here")

@pytest.mark.skipif(True, reason="gadget extra missing")
def test_skipif():
    pass

@pytest.mark.slow
def test_deselected():
    pytest.skip("never runs")
""",
    "test_b.py": """
import pytest
pytest.importorskip("no_such_module_for_ci_hook")

def test_never_collected():
    pass
""",
}


def run_pytest_with_our_conftest(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    for name in ("conftest.py", "unit_guard.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / name)
    for name, text in CI_TESTS.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "not slow", "--rootdir", str(tmp_path)]
        + ["-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ci_turns_every_skip_into_a_failure_naming_its_reason(tmp_path):
    out = run_pytest_with_our_conftest(tmp_path, ci=True)
    assert out.returncode == 1, out.stdout + out.stderr
    for reason in ("no widget here", "gadget extra missing", "no_such_module_for_ci_hook"):
        assert reason in out.stdout, out.stdout
    assert "never runs" not in out.stdout  # deselected by marker: not a skip
    # A skip at run time fails, one in setup (skipif) errors, one at collection fails the run from the summary.
    assert "1 failed, 1 passed, 1 skipped, 1 deselected, 1 error" in out.stdout, out.stdout
    assert "FAILED (skipped at collection) test_b.py" in out.stdout


def test_outside_ci_a_skip_is_a_skip(tmp_path):
    out = run_pytest_with_our_conftest(tmp_path, ci=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 3 skipped, 1 deselected" in out.stdout, out.stdout
