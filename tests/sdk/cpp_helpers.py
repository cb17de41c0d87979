"""What the C++ SDK's tests share: the toolchain check, the SDK's examples built once per session (test_cpp.py and
test_cpp_multi_agent.py build into one directory, so the second build has nothing to do), env sources compiled
against the headers, and an env server binary running on a free port."""

from __future__ import annotations

import shutil
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest
from sdk_helpers import server_process

from areal_agents.net import free_port

SDK = Path(__file__).resolve().parents[2] / "sdk" / "cpp"


def require_toolchain() -> None:
    """Skip (a failure under CI=true) when the compiler, cmake or the Debian packages are missing."""
    missing = [tool for tool in ("g++", "cmake", "pkg-config") if shutil.which(tool) is None]
    if not missing:
        for package in ("cpp-httplib", "nlohmann_json"):
            if subprocess.run(["pkg-config", "--exists", package], timeout=30).returncode != 0:
                missing.append(f"{package} (Debian: libcpp-httplib-dev / nlohmann-json3-dev)")
    if missing:
        pytest.skip(f"the C++ SDK needs {', '.join(missing)}")


def run_checked(args: list[str], timeout: float) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")


def build_examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SDK's examples built (the directory holding guess_number, sum_product, play_episode and generate)."""
    require_toolchain()
    out = tmp_path_factory.getbasetemp() / "cpp-build"
    run_checked(["cmake", "-S", str(SDK), "-B", str(out)], timeout=120)
    run_checked(["cmake", "--build", str(out), "-j2"], timeout=600)
    return out


def compile_env(source: str, out: Path, name: str) -> Path:
    """``source`` (a whole env server) compiled against the SDK's headers with warnings as errors, as ``out/name``."""
    require_toolchain()
    (out / f"{name}.cpp").write_text(source)
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "cpp-httplib", "nlohmann_json"], capture_output=True, text=True, timeout=30
    ).stdout.split()
    compile_ = ["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{SDK / 'include'}", str(out / f"{name}.cpp")]
    run_checked([*compile_, "-o", str(out / name), *flags, "-pthread"], timeout=300)
    return out / name


class CppServer:
    """A C++ env server binary on a free port, healthy, stopped by ``stop``."""

    def __init__(self, binary: Path, *args: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._running = ExitStack()
        self.process = self._running.enter_context(server_process([str(binary), "--port", str(port), *args], self.url))

    def stop(self) -> None:
        self._running.close()
