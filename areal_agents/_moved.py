"""Old module paths, importable for one release: each warns and gives the module at its new path.

`MOVED` maps an old dotted path to its new one (or to several, for a module split by concept: the old
name then holds the public names of each). A finder at the end of ``sys.meta_path`` serves them, so the
tree holds only real modules; ``import areal_agents`` installs it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

MOVED: dict[str, str | tuple[str, ...]] = {
    "areal_agents.engines.hf_engine": "areal_agents.engines.hf.engine",
    "areal_agents.engines.kv_buffer": "areal_agents.engines.hf.kv_buffer",
    "areal_agents.engines.prefix_cache": "areal_agents.engines.hf.prefix_cache",
    "areal_agents.engines.llama_decode": "areal_agents.engines.hf.decode_step",
    "areal_agents.engines.segmented_attention": "areal_agents.engines.hf.segmented_attention",
    "areal_agents.engines.sampling": "areal_agents.engines.hf.sampling",
    "areal_agents.engines.process_engine": "areal_agents.engines.hf.process_engine",
    "areal_agents.engines.request_checks": "areal_agents.engines.hf.request_checks",
    "areal_agents.engines.sglang_engine": "areal_agents.engines.sglang.client",
    "areal_agents.engines.sglang_protocol": "areal_agents.engines.sglang.protocol",
    "areal_agents.engines.serve_model": "areal_agents.engines.model_server",
    "areal_agents.engines.launcher": "areal_agents.engines.local_servers",
    "areal_agents.engines.server_supervisor": "areal_agents.engines.supervisor",
    "areal_agents.envs.pool": "areal_agents.envs.runtime.pool",
    "areal_agents.envs.server": "areal_agents.envs.runtime.server",
    "areal_agents.envs.protocol": "areal_agents.envs.runtime.protocol",
    "areal_agents.envs.remote": "areal_agents.envs.runtime.remote",
    "areal_agents.envs.backends": "areal_agents.envs.runtime.backends",
    "areal_agents.rewards.math": "areal_agents.rewards.math_verifier",
    "areal_agents.rewards.code": "areal_agents.rewards.code_judge",
    "areal_agents.cluster.launcher": "areal_agents.cluster.ray_launcher",
    "areal_agents.rollout.evaluate": "areal_agents.rollout.held_out",
    "areal_agents.trainers.metrics": "areal_agents.trainers.metrics_writer",
    "areal_agents.trainers.setup": ("areal_agents.trainers.optim", "areal_agents.trainers.run_start"),
    "areal_agents.agents.template_messages": "areal_agents.agents.assistant_turns",
    "areal_agents.engines.broadcast": "areal_agents.engines.broadcast_group",
    "areal_agents.engines.hf.lora": "areal_agents.engines.hf.multi_lora",
    "areal_agents.engines.hf.placement": "areal_agents.engines.hf.engine_placement",
    "areal_agents.engines.weight_checks": "areal_agents.models.weight_checks",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED` (and nothing else); loading one warns and returns the new module."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        names = (new,) if isinstance(new, str) else new
        warnings.warn(
            f"{spec.name} moved to {' and '.join(names)}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        if isinstance(new, str):
            return importlib.import_module(new)
        merged = types.ModuleType(spec.name, f"Deprecated: split into {', '.join(names)}.")
        for module in map(importlib.import_module, names):
            merged.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("_")})
        return merged

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported."""


def install() -> None:
    """Serve the old paths (once per process)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
