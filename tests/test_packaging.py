"""The installed package, not the checkout: a non-editable wheel carries every bundled dataset.

`pip install -e .` reads package data from the checkout, so an undeclared data file goes unnoticed there.
This builds a wheel from a copy of the checkout, installs it into a folder of its own and loads every split
of every bundled set with a Python that sees that folder and the venv's dependencies, but neither the
checkout nor the editable install.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from areal_agents.data.builtin import BUILTIN

ROOT = Path(__file__).resolve().parents[1]
BUILTIN_DIR = ROOT / "areal_agents" / "data" / "builtin"
IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "runs", ".pytest_cache", ".ruff_cache"
)

LOAD_ALL = """
import json, sys
import areal_agents
from importlib import resources
from areal_agents.data import load_task_dataset
from areal_agents.data.builtin import BUILTIN

counts = {f"{name}/{split}": len(load_task_dataset(name, split=split))
          for name, ds in BUILTIN.items() for split in ds.files}
paths = [str(ds.path(split)) for ds in BUILTIN.values() for split in ds.files]
sources = resources.files("areal_agents.data.builtin").joinpath("SOURCES.md").read_text()
print(json.dumps({"file": areal_agents.__file__, "counts": counts, "paths": paths, "sources": len(sources)}))
"""


def rows_in(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


@pytest.mark.slow
def test_wheel_carries_every_bundled_dataset(tmp_path):
    missing = [f for ds in BUILTIN.values() for f in ds.files.values() if not (BUILTIN_DIR / f).is_file()]
    assert not missing, f"bundled files named in BUILTIN but absent from {BUILTIN_DIR}: {missing}"
    expected = {
        f"{name}/{split}": rows_in(BUILTIN_DIR / f) for name, ds in BUILTIN.items() for split, f in ds.files.items()
    }

    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, src, ignore=IGNORED)
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("areal_agents-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    assert "areal_agents/data/builtin/SOURCES.md" in names
    templates = {f"areal_agents/models/templates/{p.name}" for p in (ROOT / "areal_agents/models/templates").iterdir()}
    assert templates - names == set(), "the families' chat templates (and their SOURCES.md) must ship in the wheel"
    page = {f"areal_agents/dashboard/static/{p.name}" for p in (ROOT / "areal_agents/dashboard/static").iterdir()}
    assert page - names == set(), "the dashboard's page, script and style must ship in the wheel"
    in_checkout = {p.name for p in BUILTIN_DIR.glob("*.jsonl")}
    in_wheel = {Path(n).name for n in names if n.startswith("areal_agents/data/builtin/") and n.endswith(".jsonl")}
    assert in_checkout <= in_wheel, f"bundled files left out of the wheel: {sorted(in_checkout - in_wheel)}"

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    # -S: no site-packages and so no editable install's .pth/finder; the venv's own packages come back
    # on PYTHONPATH, after the wheel's folder. The working directory is an empty folder, not the checkout.
    deps = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(target), *deps])
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    run = subprocess.run(
        [sys.executable, "-S", "-c", LOAD_ALL], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])

    assert Path(got["file"]).resolve().is_relative_to(target.resolve()), got["file"]
    for path in got["paths"]:
        assert Path(path).resolve().is_relative_to(target.resolve()), path
    assert got["sources"] > 0
    assert got["counts"] == expected
