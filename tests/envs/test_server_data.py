"""A served env's data is the server's choice: a client loads only the datasets the operator allowed at start,
learns nothing of other paths, cannot blow an observation up with a template, and a Code-v0 step that times
out leaves no sandbox run holding a worker.

The servers here run in this process (uvicorn on a thread), except where the serve-env command itself is the
point (its ``--mode process`` workers, a run's launched server).
"""

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import threading

import pytest
from app_in_thread import serving_app

from areal_agents.cli import main
from areal_agents.config import EnvConfig
from areal_agents.envs.runtime.backends import open_env_backend
from areal_agents.envs.runtime.remote import EnvServerProcess, RemoteEnvPool
from areal_agents.envs.runtime.server import EnvServer, ServerConfig, build_app
from areal_agents.errors import ArealAgentsError
from areal_agents.net import free_port

MATH = "areal_agents/Math-v0"
SECRET = "sk-live-0123456789abcdef"
LOOP = "```python\nwhile True:\n    pass\n```"


@contextlib.contextmanager
def serving(**options):
    """An env server on a free port in this process; its port."""
    port = free_port()
    with serving_app(build_app(EnvServer(ServerConfig(port=port, **options))), port):
        yield port


def request(port, method, path, payload=None, timeout=120):
    """(status, parsed body, body size in bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = json.dumps(payload).encode() if payload is not None else None
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    return response.status, json.loads(raw or b"{}"), len(raw)


def create(port, env_id, kwargs, **extra):
    return request(port, "POST", "/v1/sessions", {"env_id": env_id, "kwargs": kwargs, "seed": 0, **extra})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A secret the server must not serve, one named dataset and a data dir with a file in a subfolder."""
    tmp_path = tmp_path_factory.mktemp("served")
    secret = tmp_path / "secrets" / "keys.jsonl"
    secret.parent.mkdir()
    secret.write_text(json.dumps({"api_key": SECRET, "owner": "ops"}) + "\n")
    secret.chmod(0o600)
    named = tmp_path / "named.jsonl"
    named.write_text(json.dumps({"problem": "What is 6*7?", "answer": "42"}) + "\n")
    data_dir = tmp_path / "data"
    (data_dir / "sub").mkdir(parents=True)
    (data_dir / "sub" / "more.jsonl").write_text(json.dumps({"problem": "What is 2+3?", "answer": "5"}) + "\n")
    (data_dir / "escape.jsonl").symlink_to(secret)
    return {"secret": secret, "named": named, "dir": data_dir}


@pytest.fixture(scope="module")
def port():
    """A server as started with no data options: bundled sets only."""
    with serving() as port:
        yield port


@pytest.fixture(scope="module")
def named_port(data):
    """A server whose operator named ``mine`` and opened the data dir."""
    with serving(datasets=[f"mine={data['named']}"], data_dirs=[str(data["dir"])]) as port:
        yield port


@pytest.mark.slow
def test_a_client_cannot_read_a_server_file_or_learn_whether_it_exists(data, port):
    """The issue's read: Math-v0 over a 0600 JSONL of API keys, its fields turned into the observation."""
    steal = {"prompt_key": "api_key", "answer_key": "api_key", "prompt_template": "{prompt}"}
    replies = {}
    for name, path in (("exists", str(data["secret"])), ("missing", str(data["secret"]) + ".gone")):
        status, body, _ = create(port, MATH, {"dataset": path, **steal})
        assert status == 400, body
        replies[name] = body["error"]["message"].replace(path, "PATH")
        assert SECRET not in json.dumps(body) and "owner" not in json.dumps(body)
    assert replies["exists"] == replies["missing"]  # the same words whether or not the file is there
    assert "not served here" in replies["exists"] and "--dataset NAME=PATH" in replies["exists"]
    debate = {"task_env": MATH, "task_kwargs": {"dataset": str(data["secret"]), **steal}}
    status, body, _ = create(port, "areal_agents/Debate-v0", debate)
    assert status == 400 and SECRET not in json.dumps(body), body


@pytest.mark.slow
def test_the_operator_named_datasets_load_and_nothing_beside_them(data, named_port):
    port = named_port
    status, body, _ = create(port, MATH, {"dataset": "mine"})
    assert status == 200 and "What is 6*7?" in body["observation"], body
    status, body, _ = create(port, MATH, {"dataset": "sub/more.jsonl"})  # under the data dir, relative to it
    assert status == 200 and "What is 2+3?" in body["observation"], body
    status, body, _ = create(port, MATH, {"dataset": "aime24"})  # bundled sets always
    assert status == 200, body
    status, body, _ = create(port, MATH, {"dataset": str(data["named"])})  # named as "mine", not by its path
    assert status == 400 and "not served here" in body["error"]["message"], body
    steal = {"prompt_key": "api_key", "answer_key": "api_key"}
    # the data dir's way out, by another spelling, by .. or by a symlink in it
    for dataset in (f"{data['dir']}/../secrets/keys.jsonl", "../secrets/keys.jsonl", "escape.jsonl"):
        status, body, _ = create(port, MATH, {"dataset": dataset, **steal})
        assert status == 400 and SECRET not in json.dumps(body), (dataset, body)


@pytest.mark.slow
@pytest.mark.parametrize(
    "template",
    [
        "{prompt}{prompt:>300000000}",
        "{prompt}{prompt!r}",
        "{prompt}{prompt.__class__.__doc__}",
        "{prompt}{prompt}",
        "{prompt}{0}",
        "x" * 40000 + "{prompt}",
    ],
)
def test_a_client_template_cannot_blow_up_or_reach_into_the_observation(port, template):
    """The issue's 80-byte request that came back as a 300 MB observation, and its relatives."""
    status, body, size = create(port, MATH, {"dataset": "aime24", "prompt_template": template})
    assert status == 400 and "prompt_template" in body["error"]["message"], body
    assert size < 2000 + 2 * len(template)  # the refusal may quote the request, no more


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_code_step_that_times_out_frees_its_worker_for_other_sessions():
    """The issue's two 90 s infinite loops on a 2-thread server: once their steps time out, a new session is
    made and stepped (before, the loops held both threads and new sessions got 504 until they ended)."""
    with serving(workers=2, step_timeout=5.0) as port:
        loops = []
        for _ in range(2):
            status, body, _ = create(port, "areal_agents/Code-v0", {"timeout_s": 90, "max_runs": 0})
            assert status == 200, body
            loops.append(body["session_id"])
        results = [None, None]

        def submit(i):
            results[i] = request(port, "POST", f"/v1/sessions/{loops[i]}/step", {"action": LOOP})

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for status, result, _ in results:  # judged as timeouts, or ended by the server's own timeout
            assert status == 200 and result["terminated"], result
            assert result["reward"] == 0.0
        status, body, _ = create(port, "areal_agents/Arithmetic-v0", {})
        assert status == 200, body
        status, result, _ = request(port, "POST", f"/v1/sessions/{body['session_id']}/step", {"action": "0"})
        assert status == 200 and result["error"] is None, result


@pytest.mark.slow
def test_serve_env_process_mode_workers_load_the_named_dataset(data):
    """``--mode process``: the workers re-make each env from its kwargs, so they know the operator's names."""
    with EnvServerProcess(mode="process", workers=1, dataset=[f"mine={data['named']}"]) as server:

        async def play():
            pool = RemoteEnvPool(server.url)
            env = pool.make(MATH, dataset="mine", reward_mode="inline")
            try:
                observation, _ = await env.areset(seed=0)
                _, reward, terminated, _, _ = await env.astep("\\boxed{42}")
                with pytest.raises(ArealAgentsError, match="not served here"):
                    await pool.make(MATH, dataset=str(data["secret"])).areset(seed=0)
            finally:
                await env.aclose()
                await pool.aclose()
            return observation, reward, terminated

        observation, reward, terminated = asyncio.run(play())
    assert "What is 6*7?" in observation and (reward, terminated) == (1.0, True)


@pytest.mark.slow
def test_a_server_backend_run_loads_the_dataset_its_config_names(data, monkeypatch):
    """env.backend=server: the launcher allows the server it starts the dataset files the run's config (and its
    eval kwargs) name, relative paths included."""
    monkeypatch.chdir(data["named"].parent)
    cfg = EnvConfig(id=MATH, kwargs={"dataset": "named.jsonl"}, backend="server", workers=1)

    async def run():
        backend = open_env_backend(cfg, datasets=["data/sub/more.jsonl"])
        try:
            await backend.check()
            await backend.check(dataset="data/sub/more.jsonl")
            with pytest.raises(ArealAgentsError, match="not served here"):
                await backend.check(dataset="secrets/keys.jsonl")
        finally:
            await backend.aclose()

    asyncio.run(run())


def test_serve_env_refuses_a_dataset_that_is_not_there_in_one_line(tmp_path, capsys):
    assert main(["serve-env", "--dataset", f"x={tmp_path}/nope.jsonl"]) == 2
    assert main(["serve-env", "--data-dir", str(tmp_path / "nodir")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no such file" in err[0] and "not a directory" in err[1], err
    assert "AREAL_AGENTS_SERVED_DATA" not in os.environ
