"""The C++ SDK's server over protocol v2 (/work/notes/v2spec.md, docs/env-protocol.md): the multi-agent example
cpp/SumProduct-v0 by its rules, every refusal of a step leaving its session as it was, batches, owners, single-agent
envs as the one agent "agent", and a turn-based env that breaks the MultiAgentEnv contract on request."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import requests
from cpp_helpers import CppServer, build_examples, compile_env
from sdk_helpers import train_two_steps

pytestmark = pytest.mark.process

SUM_PRODUCT, GUESS = "cpp/SumProduct-v0", "cpp/GuessNumber-v0"
OWNER = "test_cpp_multi_agent"
LIMITS = ["--max-sessions", "16", "--max-body-bytes", "65536", "--max-action-chars", "1000", "--idle-timeout", "5"]


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    return build_examples(tmp_path_factory)


@pytest.fixture(scope="module")
def sum_product(build):
    server = CppServer(build / "sum_product", *LIMITS)
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def guess(build):
    server = CppServer(build / "guess_number", *LIMITS)
    yield server.url
    server.stop()


@pytest.fixture(autouse=True)
def close_the_tests_sessions(request):
    """After each test, the sessions ``session`` opened on the servers it used, closed by their owner tag."""
    yield
    for server in {"sum_product", "guess", "turns"} & set(request.fixturenames):
        url = request.getfixturevalue(server)
        requests.delete(f"{url}/v2/sessions", params={"owner": OWNER}, timeout=30).raise_for_status()


def create(url: str, version: str = "v2", **body) -> requests.Response:
    return requests.post(f"{url}/{version}/sessions", json=body, timeout=30)


def session(url: str, **body) -> dict:
    """A new session (v2) owned by OWNER."""
    reply = create(url, owner=OWNER, **body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def step(url: str, sid: str, body: dict) -> requests.Response:
    return requests.post(f"{url}/v2/sessions/{sid}/step", json=body, timeout=30)


def right_answers(observations: dict[str, str]) -> dict[str, str]:
    """The adder's and the multiplier's right answers to their questions ("2+3=", "2*3=")."""
    a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", observations["adder"]).groups())
    assert observations["multiplier"] == f"{a}*{b}="
    return {"adder": str(a + b), "multiplier": str(a * b)}


def error_of(reply: requests.Response) -> tuple[int, str, str]:
    return reply.status_code, reply.json()["error"]["type"], reply.json()["error"]["message"]


def sessions_open(url: str) -> int:
    return requests.get(f"{url}/health", timeout=10).json()["sessions_open"]


# -- cpp/SumProduct-v0 --------------------------------------------------------------------------------------------


def test_health_says_the_server_speaks_v1_and_v2(sum_product):
    health = requests.get(f"{sum_product}/health", timeout=10).json()
    assert health["protocol"] == "v2" and health["protocols"] == ["v1", "v2"]


def test_the_example_passes_the_conformance_suite_with_every_v2_check(sum_product):
    """Its single-agent env cpp/Sum-v0 plays the v1 checks (and v2's for one agent), cpp/SumProduct-v0 the rest."""
    from areal_agents.envs.runtime.conformance import check_env_server

    report = check_env_server(sum_product, multi_agent_env=SUM_PRODUCT)
    assert report.env_id == "cpp/Sum-v0" and any(r.name.startswith("v2: ") for r in report.results)
    assert report.ok and not report.skipped, "\n".join(report.lines())


def test_sum_product_plays_by_its_rules(sum_product):
    url, kwargs = sum_product, {"rounds": 2, "max_operand": 9}
    first = session(url, env_id=SUM_PRODUCT, kwargs=kwargs, seed=5)
    assert (first["multi_agent"], first["agents"], first["acting"]) == (
        True,
        ["adder", "multiplier"],
        ["adder", "multiplier"],
    )
    assert first["infos"] == {"adder": {}, "multiplier": {}}
    right = right_answers(first["observations"])
    wrong = str(int(right["multiplier"]) + 1)
    one = step(url, first["session_id"], {"actions": {"adder": f"it is {right['adder']}", "multiplier": wrong}}).json()
    assert one["error"] is None and one["acting"] == ["adder", "multiplier"]
    assert one["rewards"] == {"adder": 1.0, "multiplier": 0.0}
    assert one["terminations"] == one["truncations"] == {"adder": False, "multiplier": False}
    assert one["infos"]["adder"] == {"round": 1, "answer": int(right["adder"]), "success": True}
    assert one["infos"]["multiplier"]["success"] is False
    two = step(url, first["session_id"], {"actions": right_answers(one["observations"])}).json()
    assert two["rewards"] == {"adder": 1.0, "multiplier": 1.0} and two["acting"] == [] and two["observations"] == {}
    assert two["terminations"] == {"adder": True, "multiplier": True}
    over = step(url, first["session_id"], {"actions": {"adder": "1", "multiplier": "1"}})
    assert error_of(over)[:2] == (409, "episode_over")

    again = session(url, env_id=SUM_PRODUCT, kwargs=kwargs, seed=5)  # the same seed: the same questions
    assert again["observations"] == first["observations"]
    for sid in (first["session_id"], again["session_id"]):
        closed = requests.delete(f"{url}/v2/sessions/{sid}", timeout=30).json()
        assert closed == {"session_id": sid, "closed": True}
    assert error_of(step(url, first["session_id"], {"actions": {}}))[:2] == (404, "unknown_session")


@pytest.mark.parametrize(
    ("kwargs", "named"), [({"rounds": 0}, "rounds"), ({"max_operand": "9"}, "max_operand"), ({"color": 1}, "color")]
)
def test_bad_kwargs_are_a_400_naming_the_key(sum_product, kwargs, named):
    status, type_, message = error_of(create(sum_product, env_id=SUM_PRODUCT, kwargs=kwargs))
    assert (status, type_) == (400, "bad_request") and named in message


REFUSED_STEPS = [
    ({"actions": {"adder": "1"}}, 400, "bad_request", "missing ['multiplier']"),
    ({"actions": {"adder": "1", "multiplier": "1", "judge": "1"}}, 400, "bad_request", "not acting ['judge']"),
    (
        {"actions": {"adder": "1", "multiplier": "1", **{f"x{i:02}": "" for i in range(40)}}},
        400,
        "bad_request",
        "x15', ... 24 more]",
    ),
    ({"actions": {"adder": 1, "multiplier": "1"}}, 400, "bad_request", "body.actions.adder"),
    ({"actions": ["1", "1"]}, 400, "bad_request", "body.actions"),
    ({"action": "1"}, 400, "bad_request", "body.action"),
    ({"actions": {"adder": "1", "multiplier": "1"}, "seed": 1}, 400, "bad_request", "body.seed"),
    ({"actions": {"adder": "é" * 1001, "multiplier": "1"}}, 400, "action_too_long", "agent 'adder'"),
]


@pytest.mark.parametrize(("body", "status", "type_", "said"), REFUSED_STEPS)
def test_a_refused_step_changes_nothing(sum_product, body, status, type_, said):
    url = sum_product
    sid = session(url, env_id=SUM_PRODUCT, kwargs={"rounds": 2}, seed=3)["session_id"]
    refused = error_of(step(url, sid, body))
    assert refused[:2] == (status, type_) and said in refused[2], refused
    fresh = session(url, env_id=SUM_PRODUCT, kwargs={"rounds": 2}, seed=3)
    actions = {"actions": right_answers(fresh["observations"])}
    after, alone = step(url, sid, actions).json(), step(url, fresh["session_id"], actions).json()
    assert after == {**alone, "session_id": sid}  # the session steps on as if the refusal never came


def test_v1_refuses_a_multi_agent_env_and_its_sessions(sum_product):
    status, type_, message = error_of(create(sum_product, "v1", env_id=SUM_PRODUCT))
    assert (status, type_) == (400, "bad_request")
    assert "multi-agent env (agents ['adder', 'multiplier'])" in message and "POST /v2/sessions" in message
    first = session(sum_product, env_id=SUM_PRODUCT, seed=1)
    sid = first["session_id"]
    v1_step = requests.post(f"{sum_product}/v1/sessions/{sid}/step", json={"action": "1"}, timeout=30)
    assert error_of(v1_step)[:2] == (400, "bad_request") and f"/v2/sessions/{sid}/step" in error_of(v1_step)[2]
    batch = requests.post(f"{sum_product}/v1/step", json={"steps": [{"session_id": sid, "action": "1"}]}, timeout=30)
    assert batch.json()["results"][0]["error"]["type"] == "bad_request"
    assert step(sum_product, sid, {"actions": right_answers(first["observations"])}).json()["rewards"] == {
        "adder": 1.0,
        "multiplier": 1.0,
    }


def test_a_batch_steps_each_session_in_order_and_refuses_items_alone(sum_product):
    url = sum_product
    one, two = (session(url, env_id=SUM_PRODUCT, kwargs={"rounds": 2}, seed=seed) for seed in (7, 8))
    alone = session(url, env_id=SUM_PRODUCT, kwargs={"rounds": 2}, seed=7)
    items = [
        {"session_id": one["session_id"], "actions": right_answers(one["observations"])},
        {"session_id": "nope", "actions": {}},
        {"session_id": two["session_id"], "actions": {"adder": "1"}},
    ]
    results = requests.post(f"{url}/v2/step", json={"steps": items}, timeout=30).json()["results"]
    assert [r["session_id"] for r in results] == [one["session_id"], "nope", two["session_id"]]
    assert [r["error"] and r["error"]["type"] for r in results] == [None, "unknown_session", "bad_request"]
    single = step(url, alone["session_id"], {"actions": right_answers(alone["observations"])}).json()
    assert results[0] == {**single, "session_id": one["session_id"]}  # a batch item is the single step
    assert results[1]["acting"] == [] and results[1]["rewards"] == {}

    twice = {"steps": [items[0], items[0]]}
    reply = requests.post(f"{url}/v2/step", json=twice, timeout=30)
    assert error_of(reply)[:2] == (400, "bad_request") and "appears twice" in error_of(reply)[2]
    later = step(url, one["session_id"], {"actions": right_answers(results[0]["observations"])}).json()
    assert later["infos"]["adder"]["round"] == 2  # the refused batch stepped nothing
    assert step(url, two["session_id"], {"actions": right_answers(two["observations"])}).json()["error"] is None


# -- owners ---------------------------------------------------------------------------------------------------------


def test_closing_by_owner_closes_that_owners_sessions_only(guess):
    owned = [
        create(guess, "v1", env_id=GUESS, owner="run-a.1:x_y").json()["session_id"],
        create(guess, env_id=GUESS, owner="run-a.1:x_y").json()["session_id"],
    ]
    others = [
        create(guess, env_id=GUESS, owner="run-b").json()["session_id"],
        create(guess, env_id=GUESS).json()["session_id"],
    ]
    closed = requests.delete(f"{guess}/v2/sessions", params={"owner": "run-a.1:x_y"}, timeout=30)
    assert closed.json() == {"owner": "run-a.1:x_y", "closed": 2}
    for sid in owned:
        assert error_of(step(guess, sid, {"actions": {"agent": "1"}}))[:2] == (404, "unknown_session")
    for sid in others:
        assert step(guess, sid, {"actions": {"agent": "1"}}).json()["error"] is None
    again = requests.delete(f"{guess}/v2/sessions", params={"owner": "run-a.1:x_y"}, timeout=30).json()
    assert again == {"owner": "run-a.1:x_y", "closed": 0}
    assert requests.delete(f"{guess}/v2/sessions", params={"owner": "run-b"}, timeout=30).json()["closed"] == 1
    requests.delete(f"{guess}/v2/sessions/{others[1]}", timeout=30)


@pytest.mark.parametrize("owner", ["", "a b", "x" * 129, "é", 5, None])
def test_a_bad_owner_is_a_400_naming_it(guess, owner):
    before = sessions_open(guess)
    for version in ("v1", "v2"):
        status, type_, message = error_of(create(guess, version, env_id=GUESS, owner=owner))
        assert (status, type_) == (400, "bad_request") and "body.owner" in message
    assert sessions_open(guess) == before


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("", "query.owner"),
        ("?owner=a%20b", "query.owner"),
        ("?owner=a&owner=b", "query.owner"),
        ("?owner=a&all=1", "query.all"),
    ],
)
def test_closing_by_a_bad_owner_query_is_a_400(guess, query, said):
    status, type_, message = error_of(requests.delete(f"{guess}/v2/sessions{query}", timeout=30))
    assert (status, type_) == (400, "bad_request") and said in message


# -- a single-agent env over v2 -------------------------------------------------------------------------------------


def test_a_single_agent_env_is_the_agent_named_agent_over_v2_and_steps_over_v1_too(guess):
    first = session(guess, env_id=GUESS, kwargs={"low": 1, "high": 3, "max_turns": 3}, seed=11)
    sid = first["session_id"]
    assert (first["multi_agent"], first["agents"], first["acting"]) == (False, ["agent"], ["agent"])
    assert first["observations"] == {"agent": "Guess the number between 1 and 3."}
    assert first["infos"] == {"agent": {"turn": 0}}
    refused = error_of(step(guess, sid, {"actions": {"player": "1"}}))
    assert refused[:2] == (400, "bad_request") and "missing ['agent']" in refused[2]
    v1 = requests.post(f"{guess}/v1/sessions/{sid}/step", json={"action": "no idea"}, timeout=30).json()
    assert (v1["observation"], v1["info"]) == ("Not a number.", {"turn": 1})
    two = step(guess, sid, {"actions": {"agent": "no idea"}}).json()
    assert two["observations"] == {"agent": "Not a number."} and two["rewards"] == {"agent": 0.0}
    assert two["acting"] == ["agent"] and two["infos"] == {"agent": {"turn": 2}}
    three = step(guess, sid, {"actions": {"agent": "still no idea"}}).json()
    assert three["acting"] == [] and three["truncations"] == {"agent": True} and "secret" in three["infos"]["agent"]
    assert error_of(step(guess, sid, {"actions": {"agent": "1"}}))[:2] == (409, "episode_over")
    v1_over = requests.post(f"{guess}/v1/sessions/{sid}/step", json={"action": "1"}, timeout=30)
    assert error_of(v1_over)[:2] == (409, "episode_over")
    assert requests.delete(f"{guess}/v1/sessions/{sid}", timeout=30).json()["closed"] is True


# -- a turn-based env that breaks the contract on request ----------------------------------------------------------

TURNS_ENV = r"""
#include <areal_agents/env_server.hpp>
#include <chrono>
#include <cmath>
#include <thread>

// test/Turns-v0: agents "a" and "b" take turns, "a" first, for kwargs["turns"] turns (default 4); each turn's
// action is shown to the other agent and rewarded 1. kwargs["fail"] breaks the contract: at creation "make" (the
// factory throws), "kwargs" (std::invalid_argument), "nobody" (acting() is empty), "mute" (no observation for
// "a"); at the first step "throw", "nan" (a NaN reward), "stranger" (acting() names "c"), "ended" (acting()
// names "a", who terminated), "info" (an info that is not an object), "unknown" (a reward for "c"); "slow"
// steps take 2 s.
class Turns : public areal_agents::MultiAgentEnv {
 public:
  explicit Turns(const nlohmann::json& kwargs) : fail_(kwargs.value("fail", "")), turns_(kwargs.value("turns", 4)) {
    if (fail_ == "make") throw std::runtime_error("no GPU here");
    if (fail_ == "kwargs") throw std::invalid_argument("turns: not today");
  }
  std::vector<std::string> agents() const override { return {"a", "b"}; }
  areal_agents::MultiReset reset(std::optional<std::uint64_t>, const nlohmann::json&) override {
    turn_ = 0;
    if (fail_ == "mute") return {{{"b", "wait"}}, {}};
    return {{{"a", "you start"}, {"b", "wait"}}, {}};
  }
  std::vector<std::string> acting() const override {
    if (fail_ == "nobody" || turn_ >= turns_) return {};
    if (turn_ > 0 && fail_ == "stranger") return {"c"};
    if (turn_ > 0 && fail_ == "ended") return {"a"};
    return {turn_ % 2 == 0 ? "a" : "b"};
  }
  areal_agents::MultiStep step(const std::map<std::string, std::string>& actions) override {
    if (fail_ == "throw") throw std::runtime_error("step broke");
    if (fail_ == "slow") std::this_thread::sleep_for(std::chrono::seconds(2));
    std::string me = turn_ % 2 == 0 ? "a" : "b", other = me == "a" ? "b" : "a";
    ++turn_;
    areal_agents::MultiStep out;
    out.observations[other] = me + " said " + actions.at(me);
    out.rewards[me] = fail_ == "nan" ? std::nan("") : 1.0;
    if (turn_ >= turns_ || fail_ == "ended") out.terminations = {{"a", true}, {"b", true}};
    if (fail_ == "info") out.infos[me] = 3;
    if (fail_ == "unknown") out.rewards["c"] = 1.0;
    return out;
  }
 private:
  std::string fail_;
  int turns_, turn_ = 0;
};

int main(int argc, char** argv) {
  areal_agents::EnvServer server(areal_agents::parse_server_options_or_exit(argc, argv));
  server.add_multi_agent_env("test/Turns-v0", "two agents take turns", [](const nlohmann::json& kwargs) {
    return std::make_unique<Turns>(kwargs);
  });
  return server.listen() ? 0 : 1;
}
"""
TURNS = "test/Turns-v0"


@pytest.fixture(scope="module")
def turns(tmp_path_factory):
    server = CppServer(compile_env(TURNS_ENV, tmp_path_factory.mktemp("turns"), "turns"), *LIMITS)
    yield server.url
    server.stop()


def test_agents_take_turns_as_the_env_says(turns):
    first = session(turns, env_id=TURNS, kwargs={"turns": 3})
    sid = first["session_id"]
    assert first["acting"] == ["a"] and first["observations"] == {"a": "you start", "b": "wait"}
    refused = error_of(step(turns, sid, {"actions": {"b": "me first"}}))
    assert refused[:2] == (400, "bad_request") and "missing ['a']; not acting ['b']" in refused[2]
    said = [step(turns, sid, {"actions": {agent: f"hi from {agent}"}}).json() for agent in ("a", "b", "a")]
    assert [r["acting"] for r in said] == [["b"], ["a"], []]
    assert [r["observations"] for r in said] == [
        {"b": "a said hi from a"},
        {"a": "b said hi from b"},
        {"b": "a said hi from a"},
    ]
    assert [r["rewards"] for r in said] == [{"a": 1.0}, {"b": 1.0}, {"a": 1.0}]  # the agents that acted
    assert said[0]["terminations"] == {"a": False} and said[2]["terminations"] == {"a": True, "b": True}
    requests.delete(f"{turns}/v2/sessions/{sid}", timeout=30)


def test_a_turn_based_env_passes_the_suites_multi_agent_checks(turns):
    """The v2 checks that play a multi-agent env, on one agent at a time (the server serves no single-agent env for
    the others to play)."""
    from areal_agents.envs.runtime.conformance import check_env_server
    from areal_agents.envs.runtime.conformance_v2 import V2_CHECKS

    checks = [(name, check) for name, check in V2_CHECKS if "single-agent" not in name and "owner" not in name]
    report = check_env_server(turns, env_id=TURNS, multi_agent_env=TURNS, checks=checks)
    assert report.ok and not report.skipped and len(report.results) == len(checks) > 5, "\n".join(report.lines())


@pytest.mark.parametrize(
    ("fail", "said"),
    [
        ("throw", "step broke"),
        ("nan", "reward of 'a' is not a finite number"),
        ("stranger", "acting() names 'c', not an agent ['a', 'b']"),
        ("ended", "'a' ended in this step, yet acting() names it"),
        ("info", "info must be a JSON object"),
        ("unknown", "rewards has 'c', not an agent"),
    ],
)
def test_a_step_breaking_the_contract_ends_its_episode_alone(turns, fail, said):
    sid = session(turns, env_id=TURNS, kwargs={"fail": fail})["session_id"]
    fine = session(turns, env_id=TURNS)["session_id"]
    failed = step(turns, sid, {"actions": {"a": "x"}})
    assert failed.status_code == 200 and failed.json()["error"]["type"] == "env_error", failed.text
    assert said in failed.json()["error"]["message"] and failed.json()["acting"] == []
    assert error_of(step(turns, sid, {"actions": {"a": "x"}}))[:2] == (404, "unknown_session")  # the session is gone
    assert step(turns, fine, {"actions": {"a": "x"}}).json()["error"] is None
    requests.delete(f"{turns}/v2/sessions/{fine}", timeout=30)


@pytest.mark.parametrize(
    ("fail", "status", "type_", "said"),
    [
        ("make", 500, "env_error", "no GPU here"),
        ("kwargs", 400, "bad_request", "turns: not today"),
        ("nobody", 500, "env_error", "acting() is empty after reset"),
        ("mute", 500, "env_error", "no observation for 'a'"),
    ],
)
def test_a_creation_breaking_the_contract_is_refused_and_leaves_no_session(turns, fail, status, type_, said):
    before = sessions_open(turns)
    refused = error_of(create(turns, env_id=TURNS, kwargs={"fail": fail}))
    assert refused[:2] == (status, type_) and said in refused[2], refused
    assert sessions_open(turns) == before


def test_a_second_step_while_one_runs_is_session_busy(turns):
    sid = session(turns, env_id=TURNS, kwargs={"fail": "slow"})["session_id"]
    replies: list[requests.Response] = []
    steps = [
        threading.Thread(target=lambda: replies.append(step(turns, sid, {"actions": {"a": "x"}}))) for _ in range(2)
    ]
    for thread in steps:
        thread.start()
    for thread in steps:
        thread.join(timeout=30)
    assert sorted(r.status_code for r in replies) == [200, 409]
    assert [r.json()["error"]["type"] for r in replies if r.status_code == 409] == ["session_busy"]
    assert step(turns, sid, {"actions": {"b": "y"}}).json()["acting"] == ["a"]  # the one step ran, once


# -- training against it ----------------------------------------------------------------------------------------


def first_integer(text: str) -> int | None:
    """As the example reads an answer: the first run of digits, negative after a '-'."""
    found = re.search(r"-?\d+", text)
    return int(found[0]) if found and len(found[0].lstrip("-")) <= 18 else None


def test_two_training_steps_train_both_agents_on_the_cpp_server(sum_product, tiny_dir, tmp_path):
    """MultiAgentChatAgent plays both agents over v2; each agent's turns train as its own trajectories, rewarded by
    the C++ env for exactly its right answers."""
    rollout = {"agent": "areal_agents.agents.multi_agent:MultiAgentChatAgent", "dump_trajectories": True}
    kwargs = {"max_operand": 1, "rounds": 2}
    summary = train_two_steps(sum_product, SUM_PRODUCT, kwargs, tiny_dir, tmp_path / "rl", 1, rollout=rollout)
    assert summary["episodes"]["accepted"] == 32 and summary["episodes"]["env_failed"] == 0
    assert sessions_open(sum_product) == 0  # every episode's session closed
    rows = [
        json.loads(line) for step in (1, 2) for line in (tmp_path / "rl" / f"trajectories/step_{step}.jsonl").open()
    ]
    agents_by_episode: dict[str, set[str]] = {}
    for row in rows:
        agents_by_episode.setdefault(row["metadata"]["episode"], set()).add(row["agent_id"])
    assert len(agents_by_episode) == 32 and all(a == {"adder", "multiplier"} for a in agents_by_episode.values())
    whole = [row for row in rows if row["metadata"]["segment"] == row["metadata"]["num_segments"] - 1]
    for row in whole:  # the last segment holds the whole conversation: 2 questions, 2 answers
        questions = [m["content"] for m in row["metadata"]["messages"] if m["role"] == "user"]
        answers = [m["content"] for m in row["metadata"]["messages"] if m["role"] == "assistant"]
        operator = {"adder": "+", "multiplier": "*"}[row["agent_id"]]
        assert len(questions) == len(answers) == len(row["turn_rewards"]) == 2, row["metadata"]["messages"]
        for question, answer, reward in zip(questions, answers, row["turn_rewards"]):
            a, b = map(int, re.fullmatch(rf"([01])\{operator}([01])=", question).groups())
            assert reward == float(first_integer(answer) == (a + b if operator == "+" else a * b)), (question, answer)
        assert row["reward"] == sum(row["turn_rewards"])
