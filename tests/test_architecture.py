"""The package keeps the shape docs/architecture.md gives it: one direction of imports, small modules and
functions, and a module map that names exactly the modules there are."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "areal_agents"
DOC = ROOT / "docs" / "architecture.md"

# Lowest first. A module may import its own top-level package and any package of a lower layer, nothing else
# (lazy imports included). docs/architecture.md ("Layers") says the same; change both together.
LAYERS = [
    {"types", "errors"},
    {"config", "importing", "workers", "net", "progress", "_moved", "chat", "timeline"},
    {"models", "data", "sandbox"},
    {"rewards", "engines"},
    {"envs"},
    {"agents"},
    {"rollout"},
    {"eval", "trainers"},
    {"cluster", "dashboard", "tinker"},
    {"cli"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 500
# File names several modules may share: a role that each of those packages has, so the folder says whose.
# Any other name is one module's (STYLE 4: two modules of one name are a sign of a split by size), so a
# reader, a traceback or a search never has to ask which one is meant.
SHARED_FILE_NAMES = {
    "__init__.py": "a package",
    "base.py": "a package's protocol: data, sandbox, rewards, engines, envs, agents",
    "client.py": "a serving backend's client: engines/sglang, engines/vllm",
    "server.py": (
        "a server's command line or app: engines/sglang, engines/vllm, engines/model_server, envs/runtime, "
        "rollout/gateway"
    ),
    "protocol.py": "a wire format's JSON shapes: engines/sglang, envs/runtime",
    "loading.py": "a package's loader with its errors: config (YAML and overrides), models (weights, tokenizers)",
    "multi_agent.py": "a layer's multi-agent side: envs (MultiAgentTextEnv), agents (MultiAgentChatAgent)",
}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (packages by their ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every areal_agents import in a module, at any depth, and of literal
    ``importlib.import_module("areal_agents...")`` calls."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # each name, as if a submodule: `from areal_agents import net`
            base = [node.module] if node.module else []
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] + base
            found += [(node.lineno, ".".join([*base, alias.name])) for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return sorted((line, m) for line, m in found if m == "areal_agents" or m.startswith("areal_agents."))


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_top_level_module_has_a_layer():
    unplaced = sorted({top(name) for name in modules()} - set(LAYER) - {""})
    assert not unplaced, f"give these a layer in LAYERS and in docs/architecture.md: {unplaced}"


def test_no_import_goes_up_the_layers():
    wrong = []
    for name, path in modules().items():
        here = top(name)
        if not here:
            continue  # the package's own __init__ (registers the built-in envs)
        for line, target in imported(name, path):
            there = top(target)
            if there == here:
                continue
            if not there or LAYER[there] >= LAYER[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({here} may not import {there or '?'})")
    assert not wrong, "imports against the layers (docs/architecture.md):\n" + "\n".join(wrong)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (lazily, under ``TYPE_CHECKING`` or by a literal
    ``import_module`` too). ``from pkg import name`` is an import of ``pkg.name`` when that is a module, else
    of ``pkg`` (its ``__init__``). Importing ``pkg.sub`` runs ``pkg/__init__`` first, but that edge is
    Python's, not the module's, and is not counted: otherwise every package whose ``__init__`` re-exports its
    submodules would be a circle with each of them. A submodule that imports its own package by name (``from
    pkg import x``, ``import_module("pkg")``) while that ``__init__`` imports it is a real circle and counts."""
    names = modules()
    graph = {}
    for name, path in names.items():
        targets = set()
        for _, target in imported(name, path):
            while target not in names and "." in target:
                target = target.rpartition(".")[0]  # `pkg.name` of a name that is no module: pkg
            if target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative): each is a
    set of modules that import each other around a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_no_import_circles():
    cycles = import_cycles(import_graph())
    assert not cycles, "modules that import each other around a circle (move the shared piece down):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_circle_check_finds_a_circle_and_only_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert import_cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_modules_share_a_file_name():
    by_name: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    clashes = [f"{name}: {', '.join(paths)}" for name, paths in shared.items() if name not in SHARED_FILE_NAMES]
    assert not clashes, "name each module for what it holds (old paths go to _moved.MOVED):\n" + "\n".join(clashes)
    assert not set(SHARED_FILE_NAMES) - set(shared), "SHARED_FILE_NAMES lists names no longer shared"


def test_the_layer_check_sees_lazy_and_relative_imports(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "def f():\n    from areal_agents.trainers import ppo\n"
        "from . import sibling\nimport importlib\nimportlib.import_module('areal_agents.cli')\n"
        "from areal_agents import net\n"
    )
    assert imported("areal_agents.engines.sample", source) == [
        (2, "areal_agents.trainers.ppo"),
        (3, "areal_agents.engines.sibling"),
        (5, "areal_agents.cli"),
        (6, "areal_agents.net"),
    ]


def test_no_function_or_module_too_long():
    long = []
    for path in modules().values():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                    long.append(f"{where}: {n} lines (at most {MAX_FUNCTION_LINES})")
    assert not long, "split by concept (STYLE: modules <= 500 lines, functions <= 100):\n" + "\n".join(long)


# The seams' protocols (module, class): a caller uses what they declare, with the defaults they give, and never
# probes a policy, engine, sync, agent or launched servers with getattr/hasattr for a member (issue 44).
SEAMS = [
    ("trainers/policy_api.py", "TrainablePolicy"),
    ("engines/base.py", "InferenceEngine"),
    ("engines/base.py", "LoraEngine"),
    ("engines/weight_sync.py", "WeightSource"),
    ("engines/weight_sync.py", "WeightSync"),
    ("agents/base.py", "Agent"),
    ("engines/supervisor.py", "Servers"),
]
# what such an object is called: ``policy``, ``self.engine``, ``sync``, ``agent``, ``servers``, ``view`` ...
SEAM_OBJECT = re.compile(r"(^|_)(polic(y|ies)|engines?|syncs?|agents?|servers|view)$")
# members they were once probed for, now asked through their protocols (`save_checkpoint`, `max_context`)
FORMER_PROBES = {"adapter", "limits"}


def seam_members() -> set[str]:
    """Every member the seams' protocols declare (methods, properties, annotated attributes)."""
    members = set()
    for module, name in SEAMS:
        tree = ast.parse((PACKAGE / module).read_text())
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                members.add(node.target.id)
    return {m for m in members if not m.startswith("_")} | FORMER_PROBES


def probes(source: str, members: set[str]) -> list[str]:
    """``getattr``/``hasattr`` calls in ``source`` that probe a seam object for a member by name: the object
    named as one (`SEAM_OBJECT`), or the name one of the seams' ``members`` (``getattr(p, "adapter")``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        target, attr = node.args[:2]
        if node.func.id not in ("getattr", "hasattr") or not isinstance(attr, ast.Constant):
            continue
        named = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if SEAM_OBJECT.search(named) or attr.value in members:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_probes_a_policy_engine_sync_agent_or_servers():
    members = seam_members()
    assert {"save_checkpoint", "adapter_config", "max_context", "counters", "aclose", "supervisor"} <= members
    found = [f"{path.relative_to(ROOT)}:{p}" for path in modules().values() for p in probes(path.read_text(), members)]
    assert not found, "declare the member on its protocol (with a default) and call it:\n" + "\n".join(found)


def test_the_probe_check_finds_probes_and_only_probes():
    source = """
getattr(p, "adapter", None) or p.model
hasattr(self.group.engine, "aclose")
getattr(servers, "supervisor", None)
getattr(agent, "run_episode", None)
getattr(model.config, "sliding_window", None)
getattr(torch, dtype)
getattr(engine, method)(*args)
hasattr(message, "model_dump")
"""
    found = probes(source, {"adapter", "aclose", "supervisor"})
    assert sorted(int(line.split(":")[0]) for line in found) == [2, 3, 4, 5], found


def _doc_section(title: str) -> str:
    text = DOC.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/architecture.md has no '## {title}' section"
    return match.group(1)


def mapped_paths() -> set[str]:
    """The files the module map names: a fenced tree under ``areal_agents/``, two spaces a level."""
    block = re.search(r"```text\n(areal_agents/\n.*?)```", _doc_section("Module map"), re.S)
    assert block, "the module map is a ```text block starting with 'areal_agents/'"
    paths, stack = set(), []
    for raw in block.group(1).splitlines():
        if not raw.strip():
            continue
        depth = (len(raw) - len(raw.lstrip(" "))) // 2
        name = raw.split()[0]
        stack = stack[:depth] + [name]
        if name.endswith(".py"):
            paths.add("".join(stack))
    return paths


def deprecated_paths() -> dict[str, str]:
    """Old module path -> new module path(s), from the doc's table of deprecated paths."""
    rows = re.findall(r"^\| `(areal_agents\.[\w.]+)` \| ([^|]+) \|", _doc_section("Deprecated paths"), re.M)
    return {old: " ".join(re.findall(r"`([\w.]+)`", new)) for old, new in rows}


def test_the_module_map_names_exactly_the_modules_there_are():
    tree = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")}
    mapped = mapped_paths()
    assert not mapped - tree, f"the module map names files that do not exist: {sorted(mapped - tree)}"
    assert not tree - mapped, f"add these to the module map: {sorted(tree - mapped)}"


def test_the_deprecated_paths_table_is_the_alias_table():
    from areal_agents._moved import MOVED

    assert deprecated_paths() == {old: new if isinstance(new, str) else " ".join(new) for old, new in MOVED.items()}


@pytest.mark.process
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_deprecated_paths_still_import_their_new_modules():
    import importlib

    from areal_agents._moved import MOVED

    for old, new in MOVED.items():
        assert not (PACKAGE.parent / (old.replace(".", "/") + ".py")).exists(), f"{old}: the tree holds real modules"
        module = importlib.import_module(old)
        for name in (new,) if isinstance(new, str) else new:
            target = importlib.import_module(name)
            if isinstance(new, str):
                assert module is target, f"{old} should be {new}"
            else:
                public = [k for k in vars(target) if not k.startswith("_")]
                assert all(getattr(module, k) is getattr(target, k) for k in public), f"{old} lacks names of {name}"


def test_importing_a_deprecated_path_warns_and_names_the_new_one():
    import importlib
    import sys

    sys.modules.pop("areal_agents.engines.hf_engine", None)
    with pytest.warns(
        DeprecationWarning, match=r"areal_agents\.engines\.hf_engine moved to areal_agents\.engines\.hf\.engine"
    ):
        from areal_agents.engines.hf_engine import HFEngine  # noqa: F401
    sys.modules.pop("areal_agents.engines.hf_engine", None)
    assert importlib.util.find_spec("areal_agents.engines.no_such_module") is None  # the finder serves only MOVED


def defined_names() -> set[str]:
    """Every class, function, method and module name the package defines."""
    names = set()
    for name, path in modules().items():
        names.add(name.rpartition(".")[2])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
    return names


def test_the_training_and_serving_picture_names_only_what_exists():
    """Each CamelCase or snake_case name in docs/architecture.md's "Training and serving" is defined."""
    text = DOC.read_text()
    section = text[text.index("## Training and serving") : text.index("## The episode runner")]
    words = set(re.findall(r"\b[A-Z][a-z]+[A-Z]\w*\b|\b[a-z]+_[a-z_]+\b", section))
    not_code = {"step_N", "policy_api", "trainers"}  # a directory, a module path's part
    missing = sorted(w for w in words - not_code if w not in defined_names())
    assert not missing, f"docs/architecture.md names what the package does not define: {missing}"
