"""`areal-agents dashboard RUN [RUN ...]`: a local page of live curves, the workers' timeline and a trajectory
viewer over train runs (docs/dashboard.md). It reads only the run directories it is given.

    from areal_agents.dashboard import build_app, serve
    serve(["runs/arith/rl"], port=8790)      # http://127.0.0.1:8790/
"""

from areal_agents.dashboard.app import build_app, serve
from areal_agents.dashboard.runs import ClientError, RunSet

__all__ = ["ClientError", "RunSet", "build_app", "serve"]
