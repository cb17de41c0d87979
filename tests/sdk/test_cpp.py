"""The C++ SDK (sdk/cpp): its env server against the conformance suite and a training run, its env client
against the Python serve-env, its model client against serve-model, and its typed errors."""

from __future__ import annotations

import json
import os
import re
import selectors
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
from cpp_helpers import SDK, CppServer, build_examples, compile_env, require_toolchain, run_checked
from sdk_helpers import slow_requests, train_two_steps

from areal_agents.envs import make_env
from areal_agents.models import load_tokenizer
from areal_agents.net import free_port

pytestmark = pytest.mark.process

GUESS = "cpp/GuessNumber-v0"
LIMITS = ["--max-sessions", "16", "--max-body-bytes", "65536", "--max-action-chars", "1000", "--idle-timeout", "5"]


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """The SDK's examples, built once (the directory holding guess_number, play_episode and generate)."""
    return build_examples(tmp_path_factory)


@pytest.fixture(scope="module")
def guess_server(build):
    server = CppServer(build / "guess_number", *LIMITS)
    yield server
    server.stop()


def create(url: str, **body) -> requests.Response:
    return requests.post(f"{url}/v1/sessions", json=body, timeout=30)


def step(url: str, sid: str, action: str) -> requests.Response:
    return requests.post(f"{url}/v1/sessions/{sid}/step", json={"action": action}, timeout=30)


# -- the env server ------------------------------------------------------------------------------------------


def without_a_multi_agent_env(report) -> list[str]:
    """The v2 checks that play a multi-agent env, skipped on a server without one (test_cpp_multi_agent.py runs them
    against cpp/SumProduct-v0)."""
    skipped = [r for r in report.results if r.status == "SKIP" and "no multi-agent env to play" in r.detail]
    assert skipped and all(r.name.startswith("v2: ") for r in skipped), report.lines()
    return [r.name for r in skipped]


def test_guess_number_passes_the_conformance_suite(guess_server):
    from areal_agents.envs.runtime.conformance import check_env_server

    report = check_env_server(guess_server.url, env_id=GUESS)
    assert report.ok and report.skipped == without_a_multi_agent_env(report), "\n".join(report.lines())


def test_guess_number_plays_by_its_rules(guess_server):
    url, kwargs = guess_server.url, {"low": 1, "high": 3, "max_turns": 3}
    first = create(url, env_id=GUESS, kwargs=kwargs, seed=11).json()
    assert first["observation"] == "Guess the number between 1 and 3." and first["info"] == {"turn": 0}
    missed = [step(url, first["session_id"], "no idea").json() for _ in range(3)]
    assert [r["observation"] for r in missed] == ["Not a number."] * 3 and [r["reward"] for r in missed] == [0.0] * 3
    assert [r["info"].get("secret") for r in missed[:2]] == [None, None]  # the secret shows once the episode ended
    assert missed[2]["truncated"] and not missed[2]["terminated"]
    secret = missed[2]["info"]["secret"]

    again = create(url, env_id=GUESS, kwargs=kwargs, seed=11).json()  # the same seed: the same secret
    wrong = 2 if secret != 2 else 1
    hint = step(url, again["session_id"], str(wrong)).json()
    assert hint["observation"] == ("Higher." if wrong < secret else "Lower.") and hint["info"] == {"turn": 1}
    solved = step(url, again["session_id"], f"I say {secret}, not 9").json()  # the first integer counts
    assert (solved["observation"], solved["reward"], solved["terminated"], solved["truncated"]) == (
        "Correct!",
        1.0,
        True,
        False,
    )
    assert solved["info"] == {"turn": 2, "secret": secret}
    for sid in (first["session_id"], again["session_id"]):
        assert requests.delete(f"{url}/v1/sessions/{sid}", timeout=30).json() == {"session_id": sid, "closed": True}


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"high": "ten"}, "high"),
        ({"color": 1}, "color"),
        ({"low": 5, "high": 1}, "low"),
        ({"max_turns": 0}, "max_turns"),
    ],
)
def test_bad_kwargs_are_a_400_naming_the_key(guess_server, kwargs, named):
    reply = create(guess_server.url, env_id=GUESS, kwargs=kwargs)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "bad_request"
    assert named in reply.json()["error"]["message"]


def test_port_zero_picks_a_free_port_and_prints_it(build):
    process = subprocess.Popen([str(build / "guess_number"), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            assert selector.select(timeout=30), "guess_number printed nothing within 30 s"
        line = process.stdout.readline()
        match = re.fullmatch(r"serving envs on (http://127\.0\.0\.1:(\d+))\n", line)
        assert match and int(match[2]) > 0, line
        assert requests.get(f"{match[1]}/health", timeout=10).json()["status"] == "ok"
    finally:
        process.kill()
        process.wait(timeout=10)
        process.stdout.close()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--max-sessions", "x"], "--max-sessions"),
        (["--port", "70000"], "--port"),
        (["--idle-timeout", "-1"], "--idle-timeout"),
        (["--threads"], "--threads"),
        (["--max-sesions", "4"], "--max-sesions"),
        (["--read-timeout", "0.5"], "--read-timeout"),
    ],
)
def test_a_bad_flag_exits_non_zero_naming_it(build, args, named):
    done = subprocess.run([str(build / "guess_number"), *args], capture_output=True, text=True, timeout=30)
    first_line = done.stderr.splitlines()[0]
    assert done.returncode == 2 and "error:" in first_line and named in first_line, done.stderr


def test_a_project_adding_the_sdk_as_a_subdirectory_does_not_build_the_examples(tmp_path):
    require_toolchain()
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(user_project LANGUAGES CXX)\n"
        f'add_subdirectory("{SDK.as_posix()}" areal_agents_sdk)\n'
    )
    run_checked(["cmake", "-S", str(tmp_path), "-B", str(tmp_path / "build")], timeout=120)
    targets = subprocess.run(
        ["cmake", "--build", str(tmp_path / "build"), "--target", "help"], capture_output=True, text=True, timeout=60
    ).stdout
    listed = set(re.findall(r"^\.\.\. (\w+)", targets, re.MULTILINE))
    assert "all" in listed and not {"guess_number", "play_episode", "generate"} & listed, targets


FAULTY_ENV = r"""
#include <areal_agents/env_server.hpp>
#include <chrono>
#include <thread>

// Fails where kwargs["fail"] says: make, make_invalid, reset, step, nan, info; "slow" steps take 3 s.
// With kwargs["throw_int"] true, make, reset and step throw an int (not a std::exception) instead.
// A step's info says when it started and ended (steady clock ns), so tests see which steps overlapped.
class Faulty : public areal_agents::Env {
 public:
  Faulty(std::string fail, bool throw_int) : fail_(std::move(fail)), throw_int_(throw_int) {
    if (fail_ == "make") raise<std::runtime_error>("no GPU here");
    if (fail_ == "make_invalid") throw std::invalid_argument("fail: not today");
  }
  areal_agents::Reset reset(std::optional<std::uint64_t>, const nlohmann::json&) override {
    if (fail_ == "reset") raise<std::logic_error>("reset broke");
    return {"go", {}};
  }
  areal_agents::Step step(const std::string&) override {
    if (fail_ == "step") raise<std::runtime_error>("step broke");
    auto started = now_ns();
    if (fail_ == "slow") std::this_thread::sleep_for(std::chrono::seconds(3));
    areal_agents::Step out{"ok", 0.5, false, false, {{"started_ns", started}, {"ended_ns", now_ns()}}};
    if (fail_ == "nan") out.reward = std::nan("");
    if (fail_ == "info") out.info = 3;
    return out;
  }
 private:
  template <typename Error>
  void raise(const char* message) const {
    if (throw_int_) throw 7;
    throw Error(message);
  }
  static long long now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  std::string fail_;
  bool throw_int_;
};

int main(int argc, char** argv) {
  areal_agents::EnvServer server(areal_agents::parse_server_options_or_exit(argc, argv));
  server.add_env("test/Faulty-v0", "fails on request", [](const nlohmann::json& kwargs) {
    return std::make_unique<Faulty>(kwargs.value("fail", ""), kwargs.value("throw_int", false));
  });
  return server.listen() ? 0 : 1;
}
"""


FAULTY_MAX_SESSIONS = 16


@pytest.fixture(scope="module")
def faulty_binary(build, tmp_path_factory) -> Path:
    """An env server whose factory, reset and step throw on request, compiled against the SDK's headers."""
    return compile_env(FAULTY_ENV, tmp_path_factory.mktemp("faulty"), "faulty")


@pytest.fixture(scope="module")
def faulty_server(faulty_binary):
    server = CppServer(faulty_binary, "--max-sessions", str(FAULTY_MAX_SESSIONS))
    yield server
    server.stop()


def faulty_session(url: str, fail: str, throw_int: bool = False) -> str:
    reply = create(url, env_id="test/Faulty-v0", kwargs={"fail": fail, "throw_int": throw_int})
    assert reply.status_code == 200, reply.text
    return reply.json()["session_id"]


def sessions_open(url: str) -> int:
    return requests.get(f"{url}/health", timeout=10).json()["sessions_open"]


NON_STANDARD = "threw a non-standard exception"


@pytest.mark.parametrize(
    ("fail", "throw_int", "status", "type_", "said"),
    [
        ("make", False, 500, "env_error", "no GPU here"),
        ("make_invalid", False, 400, "bad_request", "fail: not today"),
        ("reset", False, 500, "env_error", "reset broke"),
        ("make", True, 500, "env_error", NON_STANDARD),
        ("reset", True, 500, "env_error", NON_STANDARD),
    ],
)
def test_env_exceptions_at_creation_are_typed_errors_and_leave_no_session(
    faulty_server, fail, throw_int, status, type_, said
):
    before = sessions_open(faulty_server.url)
    reply = create(faulty_server.url, env_id="test/Faulty-v0", kwargs={"fail": fail, "throw_int": throw_int})
    assert reply.status_code == status and reply.json()["error"]["type"] == type_
    assert said in reply.json()["error"]["message"]
    assert sessions_open(faulty_server.url) == before


@pytest.mark.parametrize("fail", ["make", "reset"])
def test_failed_creations_give_their_place_back(faulty_server, fail):
    """More failed creations than --max-sessions, std exceptions and ints alike, still leave room for a session."""
    url = faulty_server.url
    for throw_int in (False, True) * FAULTY_MAX_SESSIONS:
        reply = create(url, env_id="test/Faulty-v0", kwargs={"fail": fail, "throw_int": throw_int})
        assert reply.status_code == 500, reply.text
    sid = faulty_session(url, "")
    assert requests.delete(f"{url}/v1/sessions/{sid}", timeout=30).status_code == 200


@pytest.mark.parametrize(("fail", "throw_int"), [("step", False), ("nan", False), ("info", False), ("step", True)])
def test_a_failing_step_ends_the_episode_with_env_error(faulty_server, fail, throw_int):
    url = faulty_server.url
    sid = faulty_session(url, fail, throw_int)
    result = step(url, sid, "x").json()
    assert result["error"]["type"] == "env_error" and result["terminated"] and not result["truncated"]
    assert (result["observation"], result["reward"], result["info"]) == ("", 0.0, {})
    assert (NON_STANDARD in result["error"]["message"]) == throw_int
    assert step(url, sid, "x").json()["error"]["type"] == "unknown_session"  # the session is gone, not busy


def test_a_second_step_on_a_busy_session_is_409_and_the_others_go_on(faulty_server):
    url = faulty_server.url
    slow, other = faulty_session(url, "slow"), faulty_session(url, "")
    first: dict = {}
    worker = threading.Thread(target=lambda: first.update(step(url, slow, "a").json()))
    worker.start()
    time.sleep(1.0)  # well into the 3 s step
    busy = step(url, slow, "b")
    meanwhile = step(url, other, "c").json()
    worker.join(timeout=10)
    assert busy.status_code == 409 and busy.json()["error"]["type"] == "session_busy"
    assert first["observation"] == "ok" and first["error"] is None and meanwhile["observation"] == "ok"
    # the other session's step ran, start to end, while the slow one was still running
    assert first["info"]["started_ns"] < meanwhile["info"]["started_ns"] < meanwhile["info"]["ended_ns"]
    assert meanwhile["info"]["ended_ns"] < first["info"]["ended_ns"]


def test_batch_items_run_concurrently_and_fail_alone(faulty_server):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("batch items run on at most one thread per core; this machine has one")
    url = faulty_server.url
    slow = [faulty_session(url, "slow") for _ in range(2)]
    broken, fine = faulty_session(url, "step"), faulty_session(url, "")
    body = {"steps": [{"session_id": sid, "action": "a"} for sid in (*slow, broken, fine)]}
    results = requests.post(f"{url}/v1/step", json=body, timeout=30).json()["results"]
    started, ended = [r["info"]["started_ns"] for r in results[:2]], [r["info"]["ended_ns"] for r in results[:2]]
    assert max(started) < min(ended)  # the two slow steps were running at one moment: side by side
    assert [r["session_id"] for r in results] == [*slow, broken, fine]
    assert [r["error"] and r["error"]["type"] for r in results] == [None, None, "env_error", None]
    assert [r["observation"] for r in results] == ["ok", "ok", "", "ok"]


def test_a_batch_item_throwing_a_non_standard_exception_fails_alone(faulty_server):
    url = faulty_server.url
    broken, fine = faulty_session(url, "step", throw_int=True), faulty_session(url, "")
    body = {"steps": [{"session_id": sid, "action": "a"} for sid in (broken, fine)]}
    results = requests.post(f"{url}/v1/step", json=body, timeout=30).json()["results"]
    assert results[0]["error"]["type"] == "env_error" and NON_STANDARD in results[0]["error"]["message"]
    assert results[1]["error"] is None and results[1]["observation"] == "ok"
    assert step(url, broken, "a").json()["error"]["type"] == "unknown_session"
    assert requests.get(f"{url}/health", timeout=10).json()["status"] == "ok"


def test_a_deeply_nested_body_is_a_400_and_the_server_lives(faulty_server):
    url, depth = faulty_server.url, 60_000
    body = '{"env_id": "test/Faulty-v0", "kwargs": {"a": ' + "[" * depth + "]" * depth + "}}"
    reply = requests.post(f"{url}/v1/sessions", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "bad_request"
    assert "nesting limit" in reply.json()["error"]["message"]
    assert requests.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    nested = {"a": json.loads("[" * 100 + "]" * 100)}  # well under the limit: an ordinary session
    sid = create(url, env_id="test/Faulty-v0", kwargs=nested).json()["session_id"]
    assert requests.delete(f"{url}/v1/sessions/{sid}", timeout=30).status_code == 200


def test_idle_sessions_expire(faulty_binary):
    server = CppServer(faulty_binary, "--idle-timeout", "1")
    try:
        sid = faulty_session(server.url, "")
        time.sleep(2.0)  # --idle-timeout 1, checked every 0.25 s
        reply = step(server.url, sid, "x")
    finally:
        server.stop()
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "unknown_session"


def test_more_connections_than_the_old_thread_count_are_all_served(guess_server):
    """A thread per open connection: 100 idle keep-alive connections, then one more, all answered at once."""
    host, port = guess_server.url.removeprefix("http://").split(":")
    connections = []
    try:
        for _ in range(101):
            connection = socket.create_connection((host, int(port)), timeout=3)
            connections.append(connection)
            connection.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            assert connection.recv(65536).startswith(b"HTTP/1.1 200"), f"connection {len(connections)}"
    finally:
        for connection in connections:
            connection.close()


@pytest.fixture(scope="module")
def quick_deadline_server(faulty_binary):
    """A server with --read-timeout 1 and 4 threads."""
    server = CppServer(faulty_binary, "--read-timeout", "1", "--threads", "4")
    yield server
    server.stop()


def test_slow_requests_are_cut_off_at_the_read_timeout_with_a_408(quick_deadline_server):
    """A byte every 0.2 s, in the request line, the headers or the body, never lets a read time out; the request's
    deadline does, also for more slow clients than threads (those waiting for one get theirs in turn)."""
    url = quick_deadline_server.url
    for what, reply, seconds in slow_requests(url, copies=2):
        assert reply is not None and reply.startswith(b"HTTP/1.1 408 "), (what, reply)
        assert b'"type":"request_timeout"' in reply and b"--read-timeout" in reply, (what, reply)
        assert seconds < 10, (what, seconds)  # long before its 20 s of bytes were sent
    assert requests.get(f"{url}/health", timeout=10).json()["status"] == "ok"


def test_a_step_longer_than_the_read_timeout_is_answered(quick_deadline_server):
    """The deadline is for reading a request, not for running it: a 3 s step under a 1 s --read-timeout."""
    sid = faulty_session(quick_deadline_server.url, "slow")
    reply = step(quick_deadline_server.url, sid, "x")
    assert reply.status_code == 200 and reply.json()["observation"] == "ok", reply.text


def test_headers_over_64_kib_are_a_431_and_the_connection_ends(guess_server):
    """Headers came without bound (200,000 lines were read into memory); now a request line and headers may have
    64 KiB together."""
    host, port = guess_server.url.removeprefix("http://").split(":")
    headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"y" * 1000) for i in range(70))
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" + headers + b"\r\n")
        reply = read_until(connection, b"}}")
        assert connection.recv(100) == b""  # closed
    assert reply.startswith(b"HTTP/1.1 431 ") and b'"type":"headers_too_large"' in reply, reply
    assert requests.get(f"{guess_server.url}/health", timeout=10).json()["status"] == "ok"


# -- training against it ----------------------------------------------------------------------------------------


def test_guess_number_passes_the_suite_at_the_default_limits(build):
    """65,536-character actions and 8 MiB bodies (4096 sessions are too many to fill, 600 s too long to idle)."""
    from areal_agents.envs.runtime.conformance import check_env_server

    server = CppServer(build / "guess_number")
    try:
        report = check_env_server(server.url, env_id=GUESS)
    finally:
        server.stop()
    expected = ["session cap (429)", "idle sessions expire", *without_a_multi_agent_env(report)]
    assert report.ok and sorted(report.skipped) == sorted(expected), "\n".join(report.lines())


def test_two_training_steps_play_episodes_on_the_cpp_server(guess_server, tiny_dir, tmp_path):
    """The run wants more episodes at once than the server's 16 sessions: its creations wait for places."""
    # every episode opens with the same observation: one held-out problem
    summary = train_two_steps(guess_server.url, GUESS, {"high": 5, "max_turns": 2}, tiny_dir, tmp_path / "rl", 1)
    assert summary["episodes"]["accepted"] == 32
    assert requests.get(f"{guess_server.url}/health", timeout=10).json()["sessions_open"] == 0


# -- the env client ------------------------------------------------------------------------------------------


def play(build: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(build / "play_episode"), *args], capture_output=True, text=True, timeout=60)


def test_play_episode_solves_arithmetic_on_the_python_server(build, serve_env_url):
    env = make_env("areal_agents/Arithmetic-v0")
    problem, _ = env.reset(seed=17)
    answer = str(env.unwrapped.problem.answer)
    done = play(build, serve_env_url, "areal_agents/Arithmetic-v0", "17", answer)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"observation: {problem}",
        f"action: {answer}",
        "reward=1 terminated=true truncated=false",
        "observation: ",
    ]


def test_play_episode_reports_an_unknown_env_in_one_line(build, serve_env_url):
    done = play(build, serve_env_url, "nope/Missing-v0", "0", "1")
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "unknown_env (HTTP 404)" in done.stderr


def test_play_episode_reports_an_unreachable_server(build):
    done = play(build, f"http://127.0.0.1:{free_port()}", GUESS, "0", "1")
    assert done.returncode == 1 and "unreachable (HTTP 0)" in done.stderr


# -- the model client -----------------------------------------------------------------------------------------


def generate(build: Path, *args: str) -> dict[str, str]:
    """The `generate` example's output lines as {field: value}."""
    done = subprocess.run([str(build / "generate"), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(line.split(": ", 1) if ": " in line else (line.rstrip(":"), "") for line in done.stdout.splitlines())


def test_greedy_generation_from_ids_and_text_agree_with_each_other_and_python(build, serve_model_url, tiny_dir):
    prompt = "12+7="
    ids = load_tokenizer(tiny_dir).encode(prompt, add_special_tokens=False)
    from_ids = generate(build, serve_model_url, "--ids", ",".join(map(str, ids)), "--max-new-tokens", "8")
    from_text = generate(build, serve_model_url, prompt, "--max-new-tokens", "8")
    python = requests.post(
        f"{serve_model_url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, "return_logprob": True},
        timeout=120,
    ).json()
    expected = ",".join(map(str, python["output_ids"]))
    assert from_ids["output_ids"] == from_text["output_ids"] == expected
    assert len(from_ids["logprobs"].split(",")) == len(python["output_ids"])
    assert from_ids["finish_reason"] == python["meta_info"]["finish_reason"]["type"]
    assert from_ids["weight_version"] == python["meta_info"]["weight_version"]


def test_chat_returns_content_and_a_finish_reason(build, serve_model_url):
    reply = generate(build, serve_model_url, "--chat", "What is 2+2?", "--max-new-tokens", "4")
    assert "content" in reply and reply["finish_reason"] in ("stop", "length")


def test_a_refused_generation_names_the_field(build, serve_model_url):
    done = subprocess.run(
        [str(build / "generate"), serve_model_url, "--ids", "1,2,999999"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "(HTTP 400)" in done.stderr and "input_ids" in done.stderr


def test_a_chunked_body_over_the_limit_is_413_and_the_connection_serves_on(guess_server):
    """cpp-httplib bounds only declared lengths: the server reads a chunked body past the limit itself, answers 413
    and drains the rest, so the connection's next request is read as one (not the body's rest, as a 400)."""
    host, port = guess_server.url.removeprefix("http://").split(":")
    chunks = b"".join(b"2000\r\n" + b"x" * 0x2000 + b"\r\n" for _ in range(20)) + b"0\r\n\r\n"  # 160 KiB > 64 KiB
    head = b"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks)
        replies = read_until(connection, b"HTTP/1.1 413 ")
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        replies += read_until(connection, b'"status":"ok"}')
    assert re.findall(rb"HTTP/1\.1 (\d{3})", replies) == [b"413", b"200"], replies[:400]


def read_until(connection: socket.socket, marker: bytes) -> bytes:
    """What the peer sends until ``marker`` has come (or it closes the connection)."""
    data = b""
    while marker not in data:
        more = connection.recv(65536)
        if not more:
            break
        data += more
    return data
