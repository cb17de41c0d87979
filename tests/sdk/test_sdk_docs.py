"""docs/env-protocol.md shows the C++ and Java example envs as the files are, so the code a reader copies is
the code tests/sdk builds, checks for conformance and trains against."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "env-protocol.md"
EMBEDDED = re.compile(r"<!-- (sdk/\S+) -->\n```(\w+)\n(.*?)```", re.DOTALL)


def test_the_protocol_page_shows_each_example_env_as_its_file_is():
    blocks = {path: (lang, body) for path, lang, body in EMBEDDED.findall(DOC.read_text())}
    assert set(blocks) == {
        "sdk/cpp/examples/guess_number.cpp",
        "sdk/cpp/examples/sum_product.cpp",
        "sdk/java/examples/GridPuzzle.java",
        "sdk/java/examples/Relay.java",
    }
    for path, (lang, body) in blocks.items():
        assert lang == {"cpp": "cpp", "java": "java"}[path.split("/")[1]]
        assert body == (ROOT / path).read_text(), f"docs/env-protocol.md's copy of {path} is out of date"
