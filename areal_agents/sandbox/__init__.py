"""Run untrusted code: the `Sandbox` API and its backends (local bubblewrap; e2b cloud in `sandbox.e2b`)."""

from areal_agents.sandbox.base import ExecResult, Sandbox, Status
from areal_agents.sandbox.local import LocalSandbox, SandboxUnavailable

__all__ = ["ExecResult", "LocalSandbox", "Sandbox", "SandboxUnavailable", "Status"]
