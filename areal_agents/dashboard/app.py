"""The dashboard's HTTP app: the page, its scripts, and a JSON API over the runs given on the command line.

Clients are hostile: a run is named by index or name, a dump by kind and step number, an episode by its row;
anything else is a 400 or 404 with a message naming the field, never a path and never a 5xx.

    app = build_app(RunSet.of(["runs/arith/rl"]))   # uvicorn.run(app, host="127.0.0.1", port=8790)

API (every route under ``/api`` answers JSON):

- ``GET /api/runs``: the runs (index, name, path, finished) and the steps with dumps
- ``GET /api/runs/{run}/scalars``: every TensorBoard scalar of the run, by tag
- ``GET /api/runs/{run}/{kind}/{step}``: the episodes of a dump (``kind``: trajectories, eval_samples),
  filtered by ``agent``, ``truncated``, ``failed``, ``min_reward``, ``max_reward``
- ``GET /api/runs/{run}/{kind}/{step}/{episode}``: one episode, decoded with the run's tokenizer
- ``GET /api/runs/{run}/timeline``: the workers' busy heatmap, gauges and steps, when the run recorded a
  timeline (`timeline_panel`)
"""

from __future__ import annotations

import socket
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from areal_agents.dashboard.runs import ClientError, Run, RunSet, parse_kind, parse_step, read_jsonl
from areal_agents.dashboard.scalars import ScalarReader
from areal_agents.dashboard.timeline_panel import TimelinePanel
from areal_agents.dashboard.tokenizers import TokenizerCache
from areal_agents.dashboard.trajectory_view import EpisodeFilter, episode_detail, summaries
from areal_agents.errors import ArealAgentsError

STATIC = ("dashboard.js", "dashboard.css")
_MEDIA = {"js": "text/javascript", "css": "text/css"}


def plotly_js() -> Path:
    """plotly.js as the ``plotly`` package ships it (no CDN: the page works offline)."""
    try:
        import plotly
    except ImportError:
        raise ArealAgentsError("the dashboard needs plotly: pip install 'areal-agents[dashboard]'") from None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise ArealAgentsError(
            f"plotly {plotly.__version__} has no bundled plotly.min.js at {path}; pip install -U plotly"
        )
    return path


class Dashboard:
    """The state behind the routes: the runs, their scalar readers and tokenizers, and the last dumps read."""

    def __init__(self, runs: RunSet, reload_seconds: float = 2.0) -> None:
        self.runs = runs
        self.scalars = {r.index: ScalarReader(r.path, reload_seconds) for r in runs.runs}
        self.timelines = {r.index: TimelinePanel(r, reload_seconds) for r in runs.runs}
        self.tokenizers = TokenizerCache()
        self._dumps: dict[Path, tuple[tuple[int, int], list[dict[str, Any]], int]] = {}
        self._lock = threading.Lock()

    def dump(self, run: Run, kind: str, step: int) -> tuple[list[dict[str, Any]], int]:
        """The rows of a dump and its skipped lines, read again when the file changed; 404 when absent."""
        path = run.dump(kind, step)
        try:
            stat = path.stat()
        except OSError:
            have = run.dump_steps(kind)
            raise ClientError(404, f"step: {run.name} has no {kind} at step {step}; steps with them: {have}") from None
        key = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._dumps.get(path)
            if cached and cached[0] == key:
                return cached[1], cached[2]
        try:
            rows, skipped = read_jsonl(path)
        except OSError as e:  # removed or unreadable since the stat
            raise ClientError(404, f"step: cannot read {run.name}'s {kind} at step {step}: {e.strerror}") from None
        with self._lock:
            if len(self._dumps) >= 8:
                self._dumps.pop(next(iter(self._dumps)))
            self._dumps[path] = (key, rows, skipped)
        return rows, skipped

    def describe(self, run: Run) -> dict[str, Any]:
        return {
            "index": run.index,
            "name": run.name,
            "path": str(run.path),
            "finished": (run.path / "summary.json").is_file(),
            "steps": {kind: run.dump_steps(kind) for kind in ("trajectories", "eval_samples")},
        }


def build_app(runs: RunSet, reload_seconds: float = 2.0) -> FastAPI:
    """The dashboard of ``runs``; TensorBoard files are re-read at most every ``reload_seconds``."""
    plotly = plotly_js()
    state = Dashboard(runs, reload_seconds)
    app = FastAPI(title="areal-agents dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    page = resources.files("areal_agents.dashboard") / "static"

    @app.exception_handler(ClientError)
    async def client_error(request: Request, e: ClientError) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, e: StarletteHTTPException) -> JSONResponse:
        why = "no such route (the page is /, the API /api/runs/...)" if e.status_code == 404 else str(e.detail)
        return JSONResponse({"detail": f"path: {why}"}, status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, e: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:])}: {err['msg']}" for err in e.errors())
        return JSONResponse({"detail": where}, status_code=400)

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return (page / "index.html").read_text(encoding="utf-8")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "runs": len(runs.runs)}

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/static/plotly.min.js")
    def plotly_route() -> FileResponse:
        return FileResponse(plotly, media_type="text/javascript")

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        if name not in STATIC:
            raise ClientError(404, f"name: no such file; the page's files are {', '.join(STATIC)}, plotly.min.js")
        return Response((page / name).read_bytes(), media_type=_MEDIA[name.rpartition(".")[2]])

    @app.get("/api/runs")
    def list_runs() -> list[dict[str, Any]]:
        return [state.describe(r) for r in runs.runs]

    @app.get("/api/runs/{run}/scalars")
    def scalars(run: str) -> dict[str, Any]:
        r = runs.get(run)
        return {"run": r.index, "tags": state.scalars[r.index].series()}

    @app.get("/api/runs/{run}/timeline")
    def timeline_route(run: str) -> dict[str, Any]:
        return state.timelines[runs.get(run).index].payload()

    @app.get("/api/runs/{run}/{kind}/{step}")
    def episodes(
        run: str,
        kind: str,
        step: str,
        agent: str | None = None,
        truncated: bool | None = None,
        failed: bool | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
    ) -> dict[str, Any]:
        r, kind, n = runs.get(run), parse_kind(kind), parse_step(step)
        rows, skipped = state.dump(r, kind, n)
        keep = EpisodeFilter(agent, truncated, failed, min_reward, max_reward)
        return {"run": r.index, "kind": kind, "step": n, "partial_lines": skipped, **summaries(rows, keep)}

    @app.get("/api/runs/{run}/{kind}/{step}/{episode}")
    def episode(run: str, kind: str, step: str, episode: str) -> dict[str, Any]:
        r, kind, n = runs.get(run), parse_kind(kind), parse_step(step)
        if not (episode.isascii() and episode.isdigit()) or len(episode) > 9:
            raise ClientError(400, f"episode: expects an episode number (its row in the step), got {episode[:40]!r}")
        rows, _ = state.dump(r, kind, n)
        tokenizer, note = state.tokenizers.get(r)
        return {
            "run": r.index,
            "kind": kind,
            "step": n,
            "tokenizer": note,
            **episode_detail(rows, int(episode), tokenizer),
        }

    return app


def serve(paths: list[str], host: str = "127.0.0.1", port: int = 8790) -> None:
    """`areal-agents dashboard`: serve the runs at ``paths`` until interrupted."""
    import uvicorn

    app = build_app(RunSet.of(paths))
    sock = listening_socket(host, port)  # a port in use fails now, not after the imports
    # The heavy imports here, before the server's threads start: importing torch (the tokenizer's loader) in one
    # request's thread while another imports tensorboard hung the server in the browser test.
    import tensorboard.backend.event_processing.event_accumulator  # noqa: F401

    import areal_agents.models.loading  # noqa: F401

    print(f"dashboard of {len(paths)} run(s): http://{host}:{port}/  (Ctrl-C stops it)", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, or a one-line error naming the flag to change (not uvicorn's exit 3)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ArealAgentsError(
            f"cannot listen on {host}:{port} ({e.strerror}): pass another --port or --host"
        ) from None
    return sock
