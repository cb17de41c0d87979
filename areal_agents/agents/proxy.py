"""The chat proxy: OpenAI's ``/v1/chat/completions`` over HTTP, every token captured per session.

Agent code in another process (or language) points its OpenAI client at a session and is trained
unchanged. The session id goes in the path (``base_url = http://HOST:PORT/s/SESSION/v1``) or, on the
plain ``/v1/chat/completions``, as the API key (``Authorization: Bearer SESSION``) or an
``X-Session-Id`` header. ``POST /s/SESSION/reward`` with ``{"reward": r, "completion_id": optional}``
sets a reward. The proxy runs inside the trainer's event loop, beside the engine it serves.

`CommandAgent` runs an agent program per episode, with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set
for its session (the OpenAI SDKs read both), the task as JSON on stdin (``{"prompt": ..., "info": ...}``),
and takes its last stdout line: ``{"reward": r}``, or ``{"answer": "..."}`` to be scored by the env.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from transformers import PreTrainedTokenizerBase

from areal_agents.agents.capture import CapturingAgent, ChatCapture
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.model_server.openai_routes import openai_error
from areal_agents.engines.model_server.openai_shapes import OpenAIRequestError
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import ArealAgentsError
from areal_agents.net import free_port
from areal_agents.types import SamplingParams, Trajectory


class InLoopServer(uvicorn.Server):
    """uvicorn as a task of the current loop: it must not take over the process's signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ChatProxy:
    """Sessions of `ChatCapture` behind an OpenAI-compatible HTTP API.

    proxy = ChatProxy()
    await proxy.start()
    sid = proxy.open(capture)            # agent code: AsyncOpenAI(base_url=proxy.base_url(sid), api_key=sid)
    ...
    proxy.close(sid)
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port or free_port(host)
        self.sessions: dict[str, ChatCapture] = {}
        self.app = self._build_app()
        self._server: InLoopServer | None = None
        self._task: asyncio.Task | None = None

    def base_url(self, session: str) -> str:
        return f"http://{self.host}:{self.port}/s/{session}/v1"

    def open(self, capture: ChatCapture) -> str:
        session = uuid.uuid4().hex
        self.sessions[session] = capture
        return session

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)

    async def start(self) -> None:
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", lifespan="off")
        self._server = InLoopServer(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # the bind failed: raise its error
                raise ArealAgentsError(f"chat proxy on {self.host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    def _capture(self, session: str) -> ChatCapture:
        capture = self.sessions.get(session)
        if capture is None:
            raise HTTPException(404, f"unknown session {session!r} (closed, or never opened by the trainer)")
        return capture

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="areal-agents chat proxy")

        async def complete(session: str, request: Request) -> JSONResponse:
            """serve-model's /v1/chat/completions shapes, errors included (``{"error": {..., "param"}}``)."""
            capture = self._capture(session)
            try:
                body = await request.json()
            except json.JSONDecodeError as e:
                return openai_error(400, f"the request body is not JSON: {e}")
            if not isinstance(body, dict) or "messages" not in body:
                return openai_error(400, "messages: the body needs a list of chat messages", "messages")
            if body.get("stream"):
                return openai_error(400, "stream: the proxy answers whole completions only (stream=false)", "stream")
            try:
                completion = await capture.create(**body)
            except OpenAIRequestError as e:
                return openai_error(400, str(e), e.param)
            except (ValueError, TypeError) as e:
                return openai_error(400, str(e))
            return JSONResponse(completion.model_dump(exclude_none=True))

        @app.post("/s/{session}/v1/chat/completions")
        async def by_path(session: str, request: Request) -> JSONResponse:
            return await complete(session, request)

        @app.post("/v1/chat/completions")
        async def by_header(
            request: Request, authorization: str = Header(""), x_session_id: str = Header("")
        ) -> JSONResponse:
            session = x_session_id or authorization.removeprefix("Bearer ").strip()
            if not session:
                raise HTTPException(401, "no session: use /s/SESSION/v1, the API key, or an X-Session-Id header")
            return await complete(session, request)

        @app.post("/s/{session}/reward")
        async def reward(session: str, body: dict[str, Any]) -> dict[str, str]:
            capture = self._capture(session)
            if not isinstance(body.get("reward"), int | float):
                raise HTTPException(400, "the body needs 'reward' (a number)")
            try:
                capture.set_reward(float(body["reward"]), body.get("completion_id"))
            except KeyError as e:
                raise HTTPException(404, str(e.args[0])) from e
            return {"status": "ok"}

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        return app


class CommandAgent(CapturingAgent):
    """An agent program in its own process, talking to the policy through the chat proxy.

    ``command``: the program and its arguments (e.g. ``["python", "my_agent.py"]``); ``timeout_s`` bounds
    one episode (the process is killed after it).
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        *,
        command: list[str],
        timeout_s: float = 600.0,
        agent_id: str = "agent",
        max_total_tokens: int = 4096,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if not command:
            raise ValueError("command: expects the agent program, e.g. ['python', 'my_agent.py']")
        super().__init__(engine, tokenizer, sampling, agent_id=agent_id, max_total_tokens=max_total_tokens)
        self.command, self.timeout_s = [sys.executable if c == "python" else c for c in command], timeout_s
        self.proxy = ChatProxy(host, port)
        self._started: asyncio.Task | None = None

    async def aclose(self) -> None:
        """Stop the proxy (the trainer calls this at the end of a run)."""
        if self._started is not None:
            await self.proxy.stop()
            self._started = None

    async def run_episode(self, env: AsyncEnv, *, seed: int | None, episode_id: str) -> list[Trajectory]:
        if self._started is None:
            self._started = asyncio.ensure_future(self.proxy.start())
        await asyncio.shield(self._started)
        capture = self.new_capture(episode_id)
        session = self.proxy.open(capture)
        try:
            prompt, info = await env.areset(seed=seed)
            last = await self._run_program(session, {"prompt": prompt, "info": info})
            if "answer" in last:
                _, reward, *_ = await env.astep(str(last["answer"]))
                capture.set_reward(float(reward))
            elif "reward" in last:
                capture.set_reward(float(last["reward"]))
        finally:
            self.proxy.close(session)
            await env.aclose()
        return capture.trajectories()

    async def _run_program(self, session: str, task: dict[str, Any]) -> dict[str, Any]:
        env = {**os.environ, "OPENAI_BASE_URL": self.proxy.base_url(session), "OPENAI_API_KEY": session}
        proc = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(json.dumps(task).encode()), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace")[-2000:]
            raise ArealAgentsError(f"agent program {self.command} exited with {proc.returncode}:\n{tail}")
        lines = out.decode(errors="replace").strip().splitlines()
        if not lines:
            return {}
        try:
            last = json.loads(lines[-1])
        except json.JSONDecodeError:
            return {}
        return last if isinstance(last, dict) else {}
