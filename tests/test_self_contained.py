"""The repo stands on its own: no file reads a `shared` folder beside the checkout (a user's clone has none)."""

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
# a parent-relative path to a folder named shared, or a path built as ... / "shared" (as tests once did)
OUTSIDE = re.compile(r"\.\./shared\b|/\s*[\"']shared[\"']")


def test_no_file_points_at_a_shared_folder_beside_the_checkout():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert len(files) > 100  # the listing worked
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".jsonl", ".png") or name == "tests/test_self_contained.py" or not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{name}:{lineno}: {line.strip()}")
    assert not hits, "\n".join(hits)
