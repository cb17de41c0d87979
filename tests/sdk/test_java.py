"""The Java SDK (sdk/java): its EnvServer passes the conformance suite and an RL run trains against it, over v1
and (with several agents) v2, its clients talk to the Python servers (serve-env, serve-model), and its JSON
carries unicode and escapes intact."""

import json
import os
import re
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sdk_helpers import server_process, slow_requests, train_two_steps

from areal_agents.cli import main
from areal_agents.envs import make_env
from areal_agents.models import load_tokenizer
from areal_agents.net import free_port

pytestmark = pytest.mark.process

SDK = Path(__file__).parents[2] / "sdk" / "java"
GRID = "java/GridPuzzle-v0"
RELAY = "java/Relay-v0"
PAIR = "test/EchoPair-v0"
GRID_LIMITS = ["--max-sessions", "16", "--max-body-bytes", "65536", "--max-action-chars", "1000", "--idle-timeout", "5"]
NASTY = 'é\n"𝄞\\ \t\u0001 \u2028 end'  # two-byte, escape-worthy, a surrogate pair, a control character


@pytest.fixture(scope="module")
def classes(tmp_path_factory):
    """The SDK, its examples and the test helpers compiled once (warnings are errors)."""
    for tool in ("javac", "java"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (the Java SDK needs a JDK 17)")
    out = tmp_path_factory.mktemp("java-classes")
    sources = sorted(str(p) for d in ("src", "examples", "tests") for p in (SDK / d).rglob("*.java"))
    built = subprocess.run(
        ["javac", "-Xlint:all,-serial", "-Werror", "-d", str(out), *sources],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    return out


def java(classes, *args, stdin=None, timeout=120, lang="C"):
    """A Java main's run, by default in the C locale: the SDK's output must be UTF-8 whatever the platform's
    default (the JVM decodes argv with the locale's charset, so non-ASCII arguments need a UTF-8 ``lang``)."""
    env = {**os.environ, "LC_ALL": lang, "LANG": lang}
    cmd = ["java", "-cp", str(classes), *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, encoding="utf-8", timeout=timeout, env=env)


@contextmanager
def java_server(classes, main_class, *flags):
    """A Java env server on a free port, healthy, killed on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with server_process(["java", "-cp", str(classes), main_class, "--port", str(port), *flags], url) as process:
        assert process.stdout.readline().strip() == f"serving envs on {url}"
        yield url


@pytest.fixture(scope="module")
def grid_server(classes):
    with java_server(classes, "GridPuzzle", *GRID_LIMITS) as url:
        yield url


@pytest.fixture(scope="module")
def probe_server(classes):
    """ProbeEnvs (test/Echo-v0): the observation is the action; the default idle timeout, so no test's session
    expires while it waits (test_idle_sessions_expire has a server of its own)."""
    with java_server(classes, "ProbeEnvs", "--max-sessions", "64") as url:
        yield url


# -- the env server ---------------------------------------------------------------------------------


def test_relay_and_grid_puzzle_pass_the_conformance_suite_v1_and_v2(relay_server):
    """The Relay example's server: GridPuzzle over v1 and v2, Relay (two agents) over v2; every check runs."""
    from areal_agents.envs.runtime.conformance import check_env_server

    report = check_env_server(relay_server, env_id=GRID, multi_agent_env=RELAY)
    assert report.ok, "\n".join(report.lines())
    assert not report.skipped, "\n".join(report.lines())
    v2_passed = [r.name for r in report.results if r.status == "PASS" and r.name.startswith("v2: ")]
    assert len(v2_passed) >= 10 and report.protocols == ["v1", "v2"], "\n".join(report.lines())


def test_the_examples_pass_the_suite_at_the_default_limits(classes):
    """65,536-character actions and 8 MiB bodies (4096 sessions are too many to fill, 600 s too long to idle)."""
    from areal_agents.envs.runtime.conformance import check_env_server

    with java_server(classes, "Relay") as url:
        report = check_env_server(url, env_id=GRID, multi_agent_env=RELAY)
    assert report.ok and report.skipped == ["session cap (429)", "idle sessions expire"], "\n".join(report.lines())


def test_rl_trains_two_steps_against_grid_puzzle(grid_server, tiny_dir, tmp_path):
    """The run wants more episodes at once than the server's 16 sessions: its creations wait for places."""
    summary = train_two_steps(grid_server, GRID, {"size": 3, "max_turns": 3}, tiny_dir, tmp_path / "rl")
    assert summary["episodes"]["accepted"] >= 2 * 4 * 4, summary["episodes"]
    assert httpx.get(f"{grid_server}/health").json()["sessions_open"] == 0  # the run closed every session


def test_grid_puzzle_plays_by_its_rules(classes, grid_server):
    """Same seed, same grid; the first move named counts; a wall bump keeps the grid with a note; G ends it."""
    first = java(classes, "PlayEpisode", "--kwargs", '{"size": 2, "max_turns": 9}', grid_server, GRID, "5")
    grid = json.loads(first.stdout.split(" ", 1)[1].strip())
    rows = grid.split("\n")[:2]
    assert rows[-1] != "Move: up, down, left or right." and "".join(rows).count(".") == 2, grid
    (a_row,) = [r for r, row in enumerate(rows) if "A" in row]
    a_col, (g_row,) = rows[a_row].index("A"), [r for r, row in enumerate(rows) if "G" in row]
    g_col = rows[g_row].index("G")
    bump = "UP then down" if a_row == 0 else "down please"  # a wall either way on a 2x2 grid
    vertical = "down" if g_row > a_row else "up"
    horizontal = "right" if g_col > a_col else "left"
    moves = [m for m, needed in ((vertical, g_row != a_row), (horizontal, g_col != a_col)) if needed]
    out = java(classes, "PlayEpisode", "--kwargs", '{"size": 2}', grid_server, GRID, "5", "jump", bump, *moves)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stderr
    assert lines[0] == first.stdout.strip().splitlines()[0]  # the seed fixes the grid
    assert json.loads(lines[1].split(" reward")[0][12:]).startswith("Unknown move.\n" + "\n".join(rows))
    assert json.loads(lines[2].split(" reward")[0][12:]).startswith("You bumped into a wall.\n" + "\n".join(rows))
    assert lines[-1].endswith("reward 1.0 terminated true truncated false"), lines


def test_bad_kwargs_are_a_400_naming_the_key(grid_server):
    for kwargs, key in (({"size": "big"}, "kwargs.size"), ({"max_turns": 0}, "kwargs.max_turns"), ({"x": 1}, "x")):
        reply = httpx.post(f"{grid_server}/v1/sessions", json={"env_id": GRID, "kwargs": kwargs})
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "bad_request", reply.text
        assert key in reply.json()["error"]["message"]


def test_env_failures_are_reported_and_leave_no_session(probe_server):
    def create(**body):
        return httpx.post(f"{probe_server}/v1/sessions", json={"env_id": "test/Echo-v0", **body})

    refused = create(options={"fail": "argument"})
    assert refused.status_code == 400 and "options.fail" in refused.json()["error"]["message"], refused.text
    failed = create(options={"fail": "state"})
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "env_error", failed.text
    sid = create(seed=3).json()["session_id"]
    result = httpx.post(f"{probe_server}/v1/sessions/{sid}/step", json={"action": "raise"}).json()
    assert result["error"]["type"] == "env_error" and "asked to raise" in result["error"]["message"]
    assert (result["terminated"], result["truncated"], result["observation"], result["reward"]) == (True, False, "", 0)
    gone = httpx.post(f"{probe_server}/v1/sessions/{sid}/step", json={"action": "x"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "unknown_session"
    assert httpx.get(f"{probe_server}/health").json()["sessions_open"] == 0


def test_a_busy_session_is_409_and_batch_items_run_concurrently(probe_server):
    sids = [
        httpx.post(f"{probe_server}/v1/sessions", json={"env_id": "test/Echo-v0"}).json()["session_id"]
        for _ in range(4)
    ]
    slow = threading.Thread(
        target=httpx.post,
        args=(f"{probe_server}/v1/sessions/{sids[0]}/step",),
        kwargs={"json": {"action": "sleep 3000"}, "timeout": 30},
    )
    slow.start()
    time.sleep(1)  # the 3 s step is running now
    busy = httpx.post(f"{probe_server}/v1/sessions/{sids[0]}/step", json={"action": "x"})
    slow.join()
    assert busy.status_code == 409 and busy.json()["error"]["type"] == "session_busy", busy.text
    batch = httpx.post(
        f"{probe_server}/v1/step", json={"steps": [{"session_id": s, "action": "sleep 600"} for s in sids]}, timeout=30
    )
    results = batch.json()["results"]
    assert [r["observation"] for r in results] == ["sleep 600"] * 4
    started, ended = [r["info"]["started_ns"] for r in results], [r["info"]["ended_ns"] for r in results]
    assert max(started) < min(ended)  # the four steps were running at one moment: side by side
    for sid in sids:
        httpx.delete(f"{probe_server}/v1/sessions/{sid}")


def test_env_close_runs_once_per_ended_session_and_never_during_a_step(probe_server):
    def create():
        return httpx.post(f"{probe_server}/v1/sessions", json={"env_id": "test/Echo-v0"}).json()["session_id"]

    def step(sid, action):
        return httpx.post(f"{probe_server}/v1/sessions/{sid}/step", json={"action": action}, timeout=30).json()

    counter = create()

    def closed():
        return int(step(counter, "closed?")["observation"])

    before = closed()
    httpx.delete(f"{probe_server}/v1/sessions/{create()}")
    step(create(), "raise")
    assert closed() == before + 2  # closed by the client, ended by a failing step
    busy = create()
    slow = threading.Thread(target=step, args=(busy, "sleep 3000"))
    slow.start()
    time.sleep(1)  # the 3 s step is running now
    assert httpx.delete(f"{probe_server}/v1/sessions/{busy}").json() == {"session_id": busy, "closed": True}
    assert closed() == before + 2  # its step is still running: the env is closed when it returns
    slow.join()
    assert closed() == before + 3
    httpx.delete(f"{probe_server}/v1/sessions/{counter}")


def test_idle_sessions_expire(classes):
    """A server of its own, so its short idle timeout cannot expire another test's sessions."""
    with java_server(classes, "ProbeEnvs", "--idle-timeout", "1.5") as url:
        sid = httpx.post(f"{url}/v1/sessions", json={"env_id": "test/Echo-v0"}).json()["session_id"]
        time.sleep(2.5)  # idle timeout 1.5 s, checked every 0.375 s
        expired = httpx.post(f"{url}/v1/sessions/{sid}/step", json={"action": "x"})
    assert expired.status_code == 404 and expired.json()["error"]["type"] == "unknown_session"


def test_stop_closes_every_env_a_busy_one_when_its_step_returns(classes):
    out = java(classes, "StopClosesEnvs", timeout=60)
    assert out.returncode == 0, out.stderr
    events = json.loads(out.stdout.splitlines()[-1])
    assert events == ["step started", "closed idle", "stop returned", "step ended", "closed busy"]


def test_slow_requests_have_their_connection_closed_at_the_read_timeout(classes):
    """A byte every 0.2 s, in the request line, the headers or the body, holds a request thread only until the
    request's deadline (--read-timeout 1), also with more slow clients than threads; a 3 s step is not cut."""
    with java_server(classes, "ProbeEnvs", "--read-timeout", "1", "--threads", "4") as url:
        cut = slow_requests(url, copies=2)
        sid = httpx.post(f"{url}/v1/sessions", json={"env_id": "test/Echo-v0"}).json()["session_id"]
        slow_step = httpx.post(f"{url}/v1/sessions/{sid}/step", json={"action": "sleep 3000"}, timeout=30)
    for what, reply, seconds in cut:
        assert reply == b"" and seconds < 10, (what, reply, seconds)  # closed, long before its 20 s of bytes
    assert slow_step.status_code == 200 and slow_step.json()["observation"] == "sleep 3000", slow_step.text


def test_bad_flags_exit_2_naming_the_flag(classes):
    flags = [(["--prot", "1"], "--prot"), (["--port", "http"], "--port"), (["--idle-timeout=-1"], "--idle")]
    for args, flag in [*flags, (["--read-timeout", "1.5"], "--read-timeout")]:
        out = java(classes, "GridPuzzle", *args, timeout=30)
        assert out.returncode == 2, out
        assert flag in out.stderr and out.stderr.count("\n") == 1, out.stderr


# -- JSON -----------------------------------------------------------------------------------------


def test_json_round_trips_and_names_the_position_of_errors(classes):
    docs = [
        {"s": NASTY, "nested": [1, -2, 3.5, 1e-7, 12345678901234, None, True, False, {"": []}], "é": {"x": {}}},
        [],
        "\U0001d11e",
        -0.25,
        {"big": 2**63, "order": {"b": 1, "a": 2}},
    ]
    lines = [json.dumps(d, ensure_ascii=ascii_only) for d in docs for ascii_only in (True, False)]
    bad = ['{"a": 1,}', "[1 2]", '"\\x"', '{"a" 1}', "01", '"abc', "tru", "[1] x", "-", '"\t"']
    out = java(classes, "JsonEcho", stdin="\n".join(lines + bad) + "\n")
    replies = out.stdout.split("\n")[:-1]  # not splitlines: U+2028 is a line break to Python
    assert out.returncode == 0 and len(replies) == len(lines) + len(bad), out
    for line, reply in zip(lines, replies):
        assert json.loads(reply) == json.loads(line)
        assert list(json.loads(reply)) == list(json.loads(line)) if reply.startswith("{") else True  # key order
    for line, reply in zip(bad, replies[len(lines) :]):
        assert re.fullmatch(r"error: .+ at position \d+", reply), (line, reply)


def test_unicode_and_escapes_survive_the_server_and_the_client(classes, probe_server):
    created = httpx.post(
        f"{probe_server}/v1/sessions",
        json={"env_id": "test/Echo-v0", "seed": 7, "kwargs": {"k": [NASTY, {"n": 1.5}]}, "options": {"o": None}},
    ).json()
    assert created["observation"] == "seed 7"
    assert created["info"] == {"kwargs": {"k": [NASTY, {"n": 1.5}]}, "options": {"o": None}}
    step = httpx.post(f"{probe_server}/v1/sessions/{created['session_id']}/step", json={"action": NASTY}).json()
    assert step["observation"] == NASTY and step["info"] == {"action": NASTY}
    out = java(classes, "PlayEpisode", probe_server, "test/Echo-v0", "1", NASTY, "end", lang="C.UTF-8")
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert json.loads(lines[1].removeprefix("observation ").split(" reward ")[0]) == NASTY
    assert lines[2] == 'observation "end" reward 0.5 terminated true truncated false'


# -- the clients against the Python servers -----------------------------------------------------------


@pytest.mark.parametrize("seed", [3, 11])
def test_play_episode_solves_arithmetic_on_python_serve_env(classes, serve_env_url, seed):
    problem = make_env("areal_agents/Arithmetic-v0").reset(seed=seed)[0]
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", problem).groups()
    answer = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    out = java(classes, "PlayEpisode", serve_env_url, "areal_agents/Arithmetic-v0", str(seed), str(answer))
    assert out.returncode == 0, out.stderr
    first, result = out.stdout.strip().splitlines()
    assert first == f"observation {json.dumps(problem)}"
    assert result.endswith("reward 1.0 terminated true truncated false"), result
    wrong = java(classes, "PlayEpisode", serve_env_url, "areal_agents/Arithmetic-v0", str(seed), str(answer + 1))
    assert "reward 0.0 terminated true" in wrong.stdout


def test_play_episode_reports_an_unknown_env_in_one_line(classes, serve_env_url):
    out = java(classes, "PlayEpisode", serve_env_url, "nope/Missing-v0", "1", "x")
    assert out.returncode != 0
    assert re.fullmatch(r"error: 404 unknown_env: .*nope/Missing-v0.*\n", out.stderr), out.stderr


def test_play_agents_plays_debate_on_python_serve_env(classes, serve_env_url):
    """The Java v2 client against the Python server: two debaters acting at once, each reading the other."""
    debaters = ["debater_0", "debater_1"]
    question = make_env("areal_agents/Debate-v0").reset(seed=3)[0]["debater_0"]
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", question).groups()
    answer = str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
    before = httpx.get(f"{serve_env_url}/health").json()["sessions_open"]  # the server is shared with other tests
    out = java(classes, "PlayAgents", serve_env_url, "areal_agents/Debate-v0", "3", answer, answer, answer)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert (lines[0]["agents"], lines[0]["acting"]) == (debaters, debaters)
    assert lines[0]["observations"] == {d: question for d in debaters}
    assert [line["acting"] for line in lines[1:]] == [debaters, []]  # two rounds, then the end
    assert all(answer in lines[1]["observations"][d] for d in debaters), lines[1]
    assert lines[2]["rewards"] == {d: 1.0 for d in debaters} and lines[2]["error"] is None, lines[2]
    assert httpx.get(f"{serve_env_url}/health").json()["sessions_open"] == before  # PlayAgents closed by owner


def test_generate_from_ids_and_text_agree_with_a_python_client(classes, serve_model_url, tiny_dir):
    prompt = "12+30="
    ids = load_tokenizer(tiny_dir).encode(prompt, add_special_tokens=False)

    def generated(*args):
        out = java(classes, "Generate", "--max-new-tokens", "6", serve_model_url, *args)
        assert out.returncode == 0, out.stderr
        return dict(line.split(" ", 1) for line in out.stdout.splitlines())

    from_ids = generated("--ids", ",".join(map(str, ids)))
    from_text = generated(prompt)
    python = httpx.post(
        f"{serve_model_url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "return_logprob": True},
        timeout=120,
    ).json()
    assert json.loads(from_ids["output_ids"]) == json.loads(from_text["output_ids"]) == python["output_ids"]
    assert json.loads(from_ids["text"]) == python["text"]
    assert from_ids["finish_reason"] == python["meta_info"]["finish_reason"]["type"]
    assert from_ids["weight_version"] == str(python["meta_info"]["weight_version"])
    expected = [lp for lp, _, _ in python["meta_info"]["output_token_logprobs"]]
    assert json.loads(from_ids["logprobs"]) == pytest.approx(expected, abs=1e-5)


def test_chat_returns_content_and_finish_reason(classes, serve_model_url):
    out = java(classes, "Generate", "--max-new-tokens", "5", serve_model_url, "--chat", "3+4?")
    assert out.returncode == 0, out.stderr
    reply = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert isinstance(json.loads(reply["content"]), str)
    assert reply["finish_reason"] in ("stop", "length")


def test_env_client_covers_the_protocol(classes, probe_server):
    out = java(classes, "ClientTour", probe_server)
    assert out.returncode == 0, out.stderr
    tour = json.loads(out.stdout)
    assert tour["envs"] == {"test/Echo-v0": "echoes the action", PAIR: "two agents echo each other"}
    assert tour["limits"] == {
        "max_sessions": 64,
        "max_body_bytes": 8388608,
        "max_action_chars": 65536,
        "idle_timeout_s": 600,
    }
    assert tour["created"] == ["seed 5", {"kwargs": {"k": 1}, "options": {"o": "p"}}, "seed null"]
    assert tour["batch"] == [["x", 0.5, False], ["end", 0.5, True]]
    assert tour["over"][0] is True and tour["over"][1]["type"] == "episode_over"
    assert tour["step_over"] == [409, "episode_over"]
    assert tour["closed_twice"] == [404, "unknown_session"]
    assert tour["unknown_env"] == [404, "unknown_env"]
    assert tour["agents_created"] == [True, ["a", "b"], ["a", "b"], {"a": "seed 4", "b": "seed 4"}]
    assert tour["agents_step"] == [{"b": "hi", "a": "yo!"}, {"a": 2.0, "b": 3.0}, ["a", "b"]]
    assert tour["agents_end"] == [[], {"a": True, "b": True}, True]
    assert tour["agents_over"] == [409, "episode_over"]
    assert tour["single"] == [False, ["agent"], {"agent": "seed null"}]
    assert tour["closed_owned"] == 2 and tour["protocols"] == ["v1", "v2"]  # the finished pair and the echo


# -- protocol v2: several agents in a session -------------------------------------------------------------


@pytest.fixture(scope="module")
def relay_server(classes):
    """The Relay example's server: java/Relay-v0 (two runners, turn by turn) and java/GridPuzzle-v0."""
    with java_server(classes, "Relay", *GRID_LIMITS) as url:
        yield url


def create_v2(url: str, env_id: str, **body) -> dict:
    reply = httpx.post(f"{url}/v2/sessions", json={"env_id": env_id, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def step_v2(url: str, sid: str, actions: dict) -> httpx.Response:
    return httpx.post(f"{url}/v2/sessions/{sid}/step", json={"actions": actions})


def refused(reply: httpx.Response, status: int, type_: str, *named: str) -> None:
    """``reply`` is the protocol's error ``type_`` with HTTP ``status``, its message naming each of ``named``."""
    assert reply.status_code == status and reply.json()["error"]["type"] == type_, reply.text
    for name in named:
        assert name in reply.json()["error"]["message"], (name, reply.text)


MULTI_AGENT = "areal_agents.agents.multi_agent:MultiAgentChatAgent"


def test_rl_trains_two_steps_against_relay_turn_by_turn(relay_server, tiny_dir, tmp_path):
    """Both runners of every episode play over v2, in turn: runner_1's chat opens with what runner_0 replied."""
    run = tmp_path / "relay"
    config = tmp_path / "relay.yaml"
    config.write_text(
        f"run_dir: {run}\nsteps: 2\nmodel: {{path: {tiny_dir}}}\n"
        f"env: {{id: {RELAY}, backend: server, server_url: {relay_server}, kwargs: {{terms: 3}}}}\n"
        f"rollout: {{agent: '{MULTI_AGENT}', batch_size: 4, group_size: 4, max_new_tokens: 4,"
        " dump_trajectories: true}\n"
        "ppo: {filter_zero_variance_groups: false}\neval: {num_problems: 4, env_kwargs: {}}\n"
    )
    assert main(["train", str(config), "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2 and summary["episodes"]["accepted"] >= 2 * 4 * 4, summary
    tokenizer = load_tokenizer(tiny_dir)
    assert httpx.get(f"{relay_server}/health").json()["sessions_open"] == 0  # the run closed every session
    for step in (1, 2):
        rows = [json.loads(line) for line in (run / "trajectories" / f"step_{step}.jsonl").read_text().splitlines()]
        by_episode = {}
        for row in rows:
            by_episode.setdefault(row["metadata"]["episode"], {})[row["agent_id"]] = row
        assert len(by_episode) >= 16 and all(set(e) == {"runner_0", "runner_1"} for e in by_episode.values())
        for episode in by_episode.values():
            first, second = episode["runner_0"]["metadata"]["messages"], episode["runner_1"]["metadata"]["messages"]
            shown = [m["content"] for m in second if m["role"] == "user"]
            assert sum(m["role"] == "assistant" for m in first) == 1 and len(shown) == 1, (first, second)  # a turn each
            row = episode["runner_0"]  # its action: the text of its generated tokens, special tokens left out
            action = tokenizer.decode(
                [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m], skip_special_tokens=True
            )
            said = re.search(r"-?[0-9]+", action)
            assert shown[0].startswith(f"runner_0 said {said.group() if said else 'no number'}; the total is "), shown
            for row in episode.values():
                assert row["reward"] in (0.0, 1.0) and len(row["turn_rewards"]) == 1, row


def test_relay_runners_take_turns_and_each_sees_what_the_other_said(relay_server):
    health = httpx.get(f"{relay_server}/health").json()
    assert (health["protocol"], health["protocols"]) == ("v2", ["v1", "v2"])
    created = create_v2(relay_server, RELAY, seed=3, kwargs={"terms": 4})
    again = create_v2(relay_server, RELAY, seed=3, kwargs={"terms": 4})
    httpx.delete(f"{relay_server}/v2/sessions/{again['session_id']}")
    assert again["observations"] == created["observations"]  # the seed fixes the numbers
    sid = created["session_id"]
    assert (created["multi_agent"], created["agents"]) == (True, ["runner_0", "runner_1"])
    assert created["acting"] == ["runner_0"] and created["infos"] == {"runner_0": {"turn": 0}}
    a, b = map(int, re.fullmatch(r"Relay: .*\. (\d+)\+(\d+)=", created["observations"]["runner_0"]).groups())
    first = step_v2(relay_server, sid, {"runner_0": f"I think {a + b}, not {a + b + 1}"}).json()
    assert (first["rewards"], first["terminations"], first["acting"]) == (
        {"runner_0": 1.0},
        {"runner_0": False},
        ["runner_1"],
    )
    seen = re.fullmatch(
        rf"runner_0 said {a + b}; the total is {a + b}\. {a + b}\+(\d+)=", first["observations"]["runner_1"]
    )
    assert seen and list(first["observations"]) == ["runner_1"], first  # only the next runner is shown anything
    total = a + b + int(seen.group(1))
    second = step_v2(relay_server, sid, {"runner_1": "no idea"}).json()  # wrong: reward 0, the relay goes on
    assert (second["rewards"], second["acting"]) == ({"runner_1": 0.0}, ["runner_0"])
    assert second["infos"] == {"runner_1": {"turn": 2, "total": total, "right": False}}
    seen = re.fullmatch(
        rf"runner_1 said no number; the total is {total}\. {total}\+(\d+)=", second["observations"]["runner_0"]
    )
    total += int(seen.group(1))
    last = step_v2(relay_server, sid, {"runner_0": str(total)}).json()
    assert (last["rewards"], last["acting"], last["observations"]) == ({"runner_0": 1.0}, [], {})
    assert last["terminations"] == {"runner_0": True, "runner_1": True} and last["error"] is None
    refused(step_v2(relay_server, sid, {"runner_1": "1"}), 409, "episode_over")
    assert httpx.delete(f"{relay_server}/v2/sessions/{sid}").json() == {"session_id": sid, "closed": True}


def test_play_agents_plays_relay_over_v2(classes, relay_server):
    """The v2 client (EnvClient.createAgents, stepAgents, closeOwned) in the PlayAgents example."""
    out = java(classes, "PlayAgents", "--kwargs", '{"terms": 3}', relay_server, RELAY, "3", "12", "12", "12")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["acting"] for line in lines] == [["runner_0"], ["runner_1"], []]
    assert lines[1]["observations"]["runner_1"].startswith("runner_0 said 12; the total is ")
    assert all(line["error"] is None for line in lines[1:]) and lines[2]["terminations"]["runner_1"] is True
    assert httpx.get(f"{relay_server}/health").json()["sessions_open"] == 0


def test_v2_refusals_are_4xx_naming_the_field_and_change_nothing(relay_server):
    url = relay_server
    sid = create_v2(url, RELAY, seed=1)["session_id"]
    bodies = [
        ({}, "bad_request", "body.actions"),
        ({"actions": "3"}, "bad_request", "body.actions"),
        ({"actions": ["3"]}, "bad_request", "body.actions"),
        ({"actions": {"runner_0": 3}}, "bad_request", "body.actions.runner_0"),
        ({"actions": {"runner_0": "3"}, "action": "3"}, "bad_request", "body.action"),
        ({"actions": {}}, "bad_request", "missing [runner_0]"),
        ({"actions": {"runner_1": "3"}}, "bad_request", "unexpected [runner_1]"),
        ({"actions": {"runner_0": "3", "runner_1": "3"}}, "bad_request", "unexpected [runner_1]"),
        ({"actions": {"runner_0": "𝄞" * 1001}}, "action_too_long", "runner_0"),
    ]
    for body, type_, named in bodies:
        refused(httpx.post(f"{url}/v2/sessions/{sid}/step", json=body), 400, type_, named)
    refused(httpx.post(f"{url}/v2/sessions/{sid}/step", content=b"{"), 400, "bad_request", "body")
    refused(httpx.post(f"{url}/v1/sessions/{sid}/step", json={"action": "3"}), 400, "bad_request", "/v2/sessions/")
    refused(step_v2(url, "nope", {"runner_0": "3"}), 404, "unknown_session")
    for owner in ("", "a b", "x" * 129, 5, "é"):
        refused(
            httpx.post(f"{url}/v2/sessions", json={"env_id": RELAY, "owner": owner}), 400, "bad_request", "body.owner"
        )
    refused(
        httpx.post(f"{url}/v1/sessions", json={"env_id": RELAY}), 400, "bad_request", "POST /v2/sessions", "runner_1"
    )
    refused(
        httpx.post(f"{url}/v2/sessions", json={"env_id": RELAY, "kwargs": {"terms": 1}}),
        400,
        "bad_request",
        "kwargs.terms",
    )
    refused(httpx.post(f"{url}/v2/sessions", json={"env_id": RELAY, "x": 1}), 400, "bad_request", "body.x")
    refused(httpx.post(f"{url}/v2/sessions", json={"env_id": "nope/None-v0"}), 404, "unknown_env", "nope/None-v0")
    refused(httpx.delete(f"{url}/v2/sessions"), 400, "bad_request", "query.owner")
    refused(httpx.delete(f"{url}/v2/sessions", params={"owner": "bad name"}), 400, "bad_request", "query.owner")
    refused(httpx.delete(f"{url}/v2/sessions", params={"owner": "a", "all": "1"}), 400, "bad_request", "query.all")
    refused(httpx.put(f"{url}/v2/sessions"), 405, "method_not_allowed")
    refused(httpx.get(f"{url}/v2/step"), 405, "method_not_allowed")
    task = create_v2(url, RELAY, seed=1)
    httpx.delete(f"{url}/v2/sessions/{task['session_id']}")
    a, b = map(int, re.findall(r"(\d+)\+(\d+)=$", task["observations"]["runner_0"])[0])
    right = step_v2(url, sid, {"runner_0": str(a + b)}).json()  # as if nothing had come before
    assert (right["rewards"], right["acting"]) == ({"runner_0": 1.0}, ["runner_1"]), right
    httpx.delete(f"{url}/v2/sessions/{sid}")


def test_v2_batches_run_each_item_and_refuse_a_malformed_batch_whole(relay_server):
    url = relay_server
    sids = [create_v2(url, RELAY, seed=s)["session_id"] for s in (1, 2)]
    steps = [
        {"session_id": sids[0], "actions": {"runner_0": "1"}},
        {"session_id": sids[0], "actions": {"runner_0": "1"}},
    ]
    refused(httpx.post(f"{url}/v2/step", json={"steps": steps}), 400, "bad_request", "appears twice")
    refused(
        httpx.post(f"{url}/v2/step", json={"steps": [{"session_id": sids[0]}]}),
        400,
        "bad_request",
        "body.steps[0].actions",
    )
    refused(
        httpx.post(f"{url}/v2/step", json={"steps": [{"session_id": sids[0], "action": "1"}]}),
        400,
        "bad_request",
        "body.steps[0].action",
    )
    items = [
        {"session_id": sids[0], "actions": {"runner_0": "1"}},
        {"session_id": "nope", "actions": {"runner_0": "1"}},
        {"session_id": sids[1], "actions": {"runner_1": "1"}},
    ]
    results = httpx.post(f"{url}/v2/step", json={"steps": items}).json()["results"]
    assert [r["session_id"] for r in results] == [sids[0], "nope", sids[1]]
    assert results[0]["error"] is None and results[0]["acting"] == ["runner_1"]  # the good item ran
    assert [r["error"]["type"] for r in results[1:]] == ["unknown_session", "bad_request"]
    assert all(r["acting"] == [] and r["rewards"] == {} for r in results[1:])
    unchanged = step_v2(url, sids[1], {"runner_0": "1"}).json()  # the refused item left its session as it was
    assert unchanged["acting"] == ["runner_1"], unchanged
    for sid in sids:
        httpx.delete(f"{url}/v1/sessions/{sid}")  # either protocol's path closes any session


def test_a_single_agent_env_is_agent_on_v2_and_steps_on_either_path(relay_server):
    url, kwargs = relay_server, {"size": 2, "max_turns": 2}
    created = create_v2(url, GRID, seed=5, kwargs=kwargs)
    v1 = httpx.post(f"{url}/v1/sessions", json={"env_id": GRID, "seed": 5, "kwargs": kwargs}).json()
    assert (created["multi_agent"], created["agents"], created["acting"]) == (False, ["agent"], ["agent"])
    assert (created["observations"], created["infos"]) == ({"agent": v1["observation"]}, {"agent": v1["info"]})
    sid = created["session_id"]
    one = step_v2(url, sid, {"agent": "jump"}).json()
    assert one["observations"]["agent"].startswith("Unknown move.") and one["acting"] == ["agent"], one
    assert (one["rewards"], one["terminations"], one["truncations"]) == (
        {"agent": 0.0},
        {"agent": False},
        {"agent": False},
    )
    two = httpx.post(f"{url}/v1/sessions/{sid}/step", json={"action": "jump"}).json()  # v1 steps it too
    assert two["truncated"] and two["info"] == {"turn": 2}, two
    refused(step_v2(url, sid, {"agent": "up"}), 409, "episode_over")
    refused(step_v2(url, v1["session_id"], {"player": "up"}), 400, "bad_request", "player", "agent")
    assert step_v2(url, v1["session_id"], {"agent": "jump"}).json()["acting"] == ["agent"]  # a v1 session on v2
    for s in (sid, v1["session_id"]):
        httpx.delete(f"{url}/v2/sessions/{s}")


def test_an_owner_closes_its_sessions_on_either_protocol_and_no_others(relay_server):
    url = relay_server
    before = httpx.get(f"{url}/health").json()["sessions_open"]
    mine = [
        create_v2(url, RELAY, owner="run-a:1.x_y")["session_id"],
        httpx.post(f"{url}/v1/sessions", json={"env_id": GRID, "owner": "run-a:1.x_y"}).json()["session_id"],
    ]
    others = [create_v2(url, RELAY, owner="run-b")["session_id"], create_v2(url, GRID)["session_id"]]
    closed = httpx.delete(f"{url}/v2/sessions", params={"owner": "run-a:1.x_y"})
    assert closed.json() == {"owner": "run-a:1.x_y", "closed": 2}, closed.text
    for sid in mine:
        refused(httpx.delete(f"{url}/v2/sessions/{sid}"), 404, "unknown_session")
    assert httpx.delete(f"{url}/v2/sessions?owner=run-a:1.x_y").json()["closed"] == 0
    assert httpx.get(f"{url}/health").json()["sessions_open"] == before + 2  # the others' two
    for sid in others:
        assert httpx.delete(f"{url}/v2/sessions/{sid}").status_code == 200


def test_agents_acting_at_once_and_env_failures_over_v2(probe_server):
    url = probe_server
    before = httpx.get(f"{url}/health").json()["sessions_open"]  # other tests' sessions on this server
    created = create_v2(url, PAIR, seed=2)
    assert (created["acting"], created["observations"]) == (["a", "b"], {"a": "seed 2", "b": "seed 2"})
    assert created["infos"] == {"a": {"role": "user"}, "b": {}}
    sid = created["session_id"]
    both = step_v2(url, sid, {"b": NASTY, "a": "yo"}).json()
    assert both["observations"] == {"a": NASTY, "b": "yo"} and both["acting"] == ["a", "b"], both
    assert both["rewards"] == {"a": 2.0, "b": float(len(NASTY.encode("utf-16-le")) // 2)}  # Java counts UTF-16 units
    assert both["terminations"] == {"a": False, "b": False} and both["infos"] == {"a": {}, "b": {}}
    left = step_v2(url, sid, {"a": "leave", "b": "x"}).json()
    assert (left["acting"], left["observations"]) == (["b"], {"b": "leave"})
    unseen = step_v2(url, sid, {"b": "x"}).json()  # b acts next but the env showed it nothing: the env's fault
    assert unseen["error"]["type"] == "env_error" and "no observation for b" in unseen["error"]["message"], unseen
    assert unseen["acting"] == [] and unseen["observations"] == {}
    refused(step_v2(url, sid, {"b": "x"}), 404, "unknown_session")  # a failed env's session is gone
    stranger = create_v2(url, PAIR)["session_id"]
    strange = step_v2(url, stranger, {"a": "stranger", "b": "x"}).json()
    assert "names z, not one of the env's agents [a, b]" in strange["error"]["message"], strange
    failing, ending = create_v2(url, PAIR)["session_id"], create_v2(url, PAIR)["session_id"]
    items = [
        {"session_id": failing, "actions": {"a": "raise", "b": "x"}},
        {"session_id": ending, "actions": {"a": "end", "b": "x"}},
    ]
    results = httpx.post(f"{url}/v2/step", json={"steps": items}).json()["results"]
    assert results[0]["error"]["type"] == "env_error" and "asked to raise" in results[0]["error"]["message"]
    assert (
        results[1]["error"] is None
        and results[1]["acting"] == []
        and results[1]["terminations"] == {"a": True, "b": True}
    )
    refused(step_v2(url, ending, {"a": "x", "b": "x"}), 409, "episode_over")
    httpx.delete(f"{url}/v2/sessions/{ending}")
    assert httpx.get(f"{url}/health").json()["sessions_open"] == before  # the failed envs' sessions are gone
