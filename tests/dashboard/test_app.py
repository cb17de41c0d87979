"""The dashboard's API on run directories written by hand (real TensorBoard event files, real JSONL dumps, the
tiny tokenizer): what it serves, and what it refuses from a hostile client (4xx naming the field, never 5xx,
never a path the client names)."""

from __future__ import annotations

import dataclasses
import json
import math
import socket

import pytest
from fastapi.testclient import TestClient
from torch.utils.tensorboard import SummaryWriter

from areal_agents.cli import build_parser, main
from areal_agents.dashboard import RunSet, build_app
from areal_agents.dashboard.runs import read_jsonl
from areal_agents.errors import ArealAgentsError
from areal_agents.models import load_tokenizer
from areal_agents.types import Trajectory


def traj(tokenizer, parts, reward=1.0, agent="agent", episode="e0", **metadata):
    """A trajectory from (text, generated) parts, versions 3 on generated tokens, logprob -0.5 there."""
    ids, mask = [], []
    for text, generated in parts:
        new = tokenizer.encode(text, add_special_tokens=False)
        ids += new
        mask += [int(generated)] * len(new)
    return Trajectory(
        input_ids=ids,
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        versions=[3 if m else -1 for m in mask],
        reward=reward,
        turn_rewards=[0.0, reward],
        agent_id=agent,
        episode_id=episode,
        metadata=metadata,
    )


def write_dump(path, trajectories, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dataclasses.asdict(t)) + "\n" for t in trajectories) + tail)


@pytest.fixture
def run(tmp_path, tiny_dir):
    """A run: config.json naming the tiny model, 3 steps of scalars, and step 2's trajectories."""
    run = tmp_path / "runs" / "rl"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"path": str(tiny_dir)}}))
    with SummaryWriter(log_dir=str(run / "tensorboard")) as w:
        for step, value in ((1, 0.25), (2, 0.5), (3, float("nan"))):
            w.add_scalar("rollout/reward_mean", value, step)
    tok = load_tokenizer(tiny_dir)
    write_dump(
        run / "trajectories" / "step_2.jsonl",
        [
            traj(tok, [("2+2=", 0), ("4", 1)], reward=1.0, episode="e0", stop_reasons=["stop"]),
            traj(tok, [("3+3=", 0), ("77", 1)], reward=0.0, agent="b", episode="e1", stop_reasons=["length"]),
            traj(tok, [("5+5=", 0), ("<call", 1)], reward=0.0, episode="e2", tool_parse_failures=1, bad=math.inf),
        ],
        tail='{"input_ids": [1, 2',  # the next row, half written
    )
    return run


@pytest.fixture
def client(run):
    with TestClient(build_app(RunSet.of([run]), reload_seconds=0)) as c:
        yield c


def detail(response):
    assert response.status_code < 500, response.text
    return response.status_code, response.json()["detail"]


def test_runs_and_scalars_come_from_the_run_directory(client, run):
    runs = client.get("/api/runs").json()
    assert runs == [
        {
            "index": 0,
            "name": "rl",
            "path": str(run),
            "finished": False,
            "steps": {"trajectories": [2], "eval_samples": []},
        }
    ]
    tags = client.get("/api/runs/rl/scalars").json()["tags"]
    assert tags["rollout/reward_mean"] == {"steps": [1, 2, 3], "values": [0.25, 0.5, None]}  # NaN: no JSON number


def test_scalars_are_read_again_while_the_run_writes(client, run):
    with SummaryWriter(log_dir=str(run / "tensorboard")) as w:
        w.add_scalar("rollout/reward_mean", 0.75, 4)
        w.add_scalar("eval/accuracy", 0.5, 4)
    tags = client.get("/api/runs/0/scalars").json()["tags"]
    assert tags["rollout/reward_mean"]["steps"] == [1, 2, 3, 4] and tags["rollout/reward_mean"]["values"][-1] == 0.75
    assert tags["eval/accuracy"] == {"steps": [4], "values": [0.5]}


def test_a_run_without_tensorboard_yet_has_no_scalars(tmp_path):
    (tmp_path / "new").mkdir()
    with TestClient(build_app(RunSet.of([tmp_path / "new"]))) as c:
        assert c.get("/api/runs/0/scalars").json()["tags"] == {}


def test_a_step_lists_its_episodes_and_leaves_the_half_written_line(client, run):
    body = client.get("/api/runs/0/trajectories/2").json()
    assert [e["episode_id"] for e in body["episodes"]] == ["e0", "e1", "e2"]
    assert body["partial_lines"] == 1 and body["total"] == 3 and body["agents"] == ["agent", "b"]
    e1 = body["episodes"][1]
    assert (e1["reward"], e1["agent_id"], e1["truncated"], e1["turn_rewards"]) == (0.0, "b", True, [0.0, 0.0])
    with (run / "trajectories" / "step_2.jsonl").open("a") as f:  # the writer finishes the line: a 4th row
        f.write(', 3], "loss_mask": [0, 1, 1], "logprobs": [0, -1, -2], "versions": [-1, 4, 4]}\n')
    body = client.get("/api/runs/0/trajectories/2").json()
    assert body["partial_lines"] == 0 and body["total"] == 4 and body["episodes"][3]["generated"] == 2


@pytest.mark.parametrize(
    "query, episodes",
    [
        ("agent=b", ["e1"]),
        ("truncated=true", ["e1"]),
        ("truncated=false", ["e0", "e2"]),
        ("failed=true", ["e2"]),
        ("min_reward=0.5", ["e0"]),
        ("max_reward=0&agent=agent", ["e2"]),
    ],
)
def test_episode_filters(client, query, episodes):
    body = client.get(f"/api/runs/0/trajectories/2?{query}").json()
    assert [e["episode_id"] for e in body["episodes"]] == episodes


def test_an_episode_is_decoded_with_the_runs_tokenizer(client, run, tiny_dir):
    ep = client.get("/api/runs/0/trajectories/2/0").json()
    row = read_jsonl(run / "trajectories" / "step_2.jsonl")[0][0]
    tok = load_tokenizer(tiny_dir)
    assert ep["tokenizer"] == str(tiny_dir) and ep["decoded"]
    assert ep["text"] == tok.decode(row["input_ids"]) == "2+2=4"
    assert [(s["text"], s["generated"]) for s in ep["spans"]] == [("2+2=", False), ("4", True)]
    assert ep["spans"][1]["generation"] == 0 and ep["spans"][1]["stop_reason"] == "stop"
    assert ep["versions"][-1] == 3 and ep["logprobs"][-1] == -0.5 and ep["reward"] == 1.0
    assert client.get("/api/runs/0/trajectories/2/2").json()["metadata"]["bad"] is None  # inf: no JSON number


def test_segments_of_a_rewritten_history_number_their_generations_after_the_earlier_ones(tmp_path, tiny_dir):
    """An episode whose template rewrote history: its second segment's generation is the episode's second."""
    tok = load_tokenizer(tiny_dir)
    meta = {"num_segments": 2, "stop_reasons": ["stop", "length"]}
    first = traj(tok, [("q", 0), ("a", 1)], episode="e", segment=0, **meta)
    second = traj(tok, [("q a r", 0), ("b", 1)], episode="e", segment=1, **meta)
    write_dump(tmp_path / "r" / "trajectories" / "step_1.jsonl", [first, second], tail='{"input_ids": [1]}\n')
    with TestClient(build_app(RunSet.of([tmp_path / "r"]))) as c:
        ep = c.get("/api/runs/0/trajectories/1/1").json()
        assert detail(c.get("/api/runs/0/trajectories/1/2")) == (
            404,
            "episode: row 2 of this step is not a trajectory (fields missing or unequal)",
        )
        assert c.get("/api/runs/0/trajectories/1").json()["bad_rows"] == 1
    gen = [s for s in ep["spans"] if s["generated"]]
    assert [(s["generation"], s["stop_reason"]) for s in gen] == [(1, "length")]
    assert (ep["segment"], ep["num_segments"]) == (1, 2)
    assert ep["decoded"] is False and ep["text"].startswith("<")  # no config.json, no checkpoint: token ids


def test_eval_samples_are_served_like_trajectories(client, run, tiny_dir):
    tok = load_tokenizer(tiny_dir)
    write_dump(run / "eval_samples" / "step_3.jsonl", [traj(tok, [("1+1=", 0), ("2", 1)], reward=1.0)])
    assert client.get("/api/runs").json()[0]["steps"]["eval_samples"] == [3]
    assert client.get("/api/runs/0/eval_samples/3/0").json()["text"] == "1+1=2"


@pytest.mark.parametrize(
    "url, status, names",
    [
        ("/api/runs/7/scalars", 404, "run: no run 7; runs are 0..0"),
        ("/api/runs/rll/scalars", 404, "run: no run named 'rll'; runs: rl. Did you mean 'rl'?"),
        ("/api/runs/..%2F..%2Fetc/scalars", 404, "run: no run named"),
        ("/api/runs/0/trajectories/abc", 400, "step: expects a step number"),
        ("/api/runs/0/trajectories/-1", 400, "step: expects a step number"),
        ("/api/runs/0/trajectories/99999999999", 400, "step: expects a step number"),
        ("/api/runs/0/trajectories/5", 404, "step: rl has no trajectories at step 5; steps with them: [2]"),
        ("/api/runs/0/eval_samples/2", 404, "no eval_samples at step 2"),
        ("/api/runs/0/checkpoints/2", 400, "kind: expects one of trajectories, eval_samples"),
        ("/api/runs/0/..%2Fconfig.json/2", 400, "kind: expects one of"),
        ("/api/runs/0/trajectories/2/3", 404, "episode: no episode 3; this step has 3 (0..2)"),  # 3: half written
        ("/api/runs/0/trajectories/2/9", 404, "episode: no episode 9; this step has"),
        ("/api/runs/0/trajectories/2/x", 400, "episode: expects an episode number"),
        ("/api/runs/0/trajectories/2?truncated=maybe", 400, "truncated:"),
        ("/api/runs/0/trajectories/2?min_reward=high", 400, "min_reward:"),
        ("/static/..%2Fapp.py", 404, "path: no such route"),
        ("/api/runs/0/trajectories/2/0/x", 404, "path: no such route"),
        ("/static/index.html", 404, "name: no such file"),
    ],
)
def test_a_hostile_client_gets_a_4xx_naming_the_field(client, url, status, names):
    code, message = detail(client.get(url))
    assert code == status and names in message, message


def test_the_page_and_its_scripts_are_served_from_the_package(client):
    page = client.get("/")
    assert page.status_code == 200 and '<script src="/static/plotly.min.js">' in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    plotly = client.get("/static/plotly.min.js")
    assert plotly.status_code == 200 and plotly.headers["content-type"].startswith("text/javascript")
    assert len(plotly.content) > 1_000_000  # the whole library, not a stub
    assert client.get("/static/dashboard.js").status_code == 200
    assert client.get("/static/dashboard.css").headers["content-type"].startswith("text/css")


def test_run_names_stay_unique_and_missing_runs_fail_at_start(tmp_path):
    for where in ("a/rl", "b/rl", "c/x/rl"):
        (tmp_path / where).mkdir(parents=True)
    runs = RunSet.of([tmp_path / "a/rl", tmp_path / "b/rl", tmp_path / "c/x/rl"])
    assert [r.name for r in runs.runs] == ["rl", "b/rl", "x/rl"]
    with pytest.raises(ArealAgentsError, match="run directory not found: .*nope"):
        RunSet.of([tmp_path / "nope"])


def test_the_dashboard_command(tmp_path, capsys):
    args = build_parser().parse_args(["dashboard", "a", "b", "--port", "9001"])
    assert (args.runs, args.port, args.host) == (["a", "b"], 9001, "127.0.0.1")
    assert main(["dashboard", str(tmp_path / "missing")]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("run directory not found: " + str(tmp_path / "missing") + " (a train run's run_dir)")
    )


def write_timeline(run, *extra: str) -> None:
    """One process's timeline file in the recorder's format: 3 bins of 0.1 s from t = 10 s, a step's span."""
    rows = [
        {"k": "meta", "process": "driver", "dt": 0.1},
        {
            "k": "bins",
            "dt": 0.1,
            "busy": {"engine/hf": [100, [1.0, 0.5, None]], "trainer/p": [100, [0.0, 0.0, 1.0]]},
            "gauges": {"rollout/queued_groups": [100, [2, 3, 4]], "cpu/driver": [100, [1.5, 1.0, 0.5]]},
        },
        {"k": "span", "track": "driver", "name": "step", "t": 10.1, "d": 0.2, "args": {"step": 1}},
    ]
    (run / "timeline").mkdir(exist_ok=True)
    (run / "timeline" / "driver.1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra))


def test_the_timeline_gives_the_heatmap_the_gauges_and_the_steps(client, run):
    assert client.get("/api/runs/0/timeline").json() == {
        "available": False,
        "why": "rl has recorded no timeline yet (RUN/timeline/)",
    }
    write_timeline(run, '{"k": "bins", "dt": 0.1, "bu')  # and a line being written
    t = client.get("/api/runs/0/timeline").json()
    assert t["available"] and t["workers"] == ["engine/hf", "trainer/p"]
    assert t["busy"] == [[1.0, 0.5, None], [0.0, 0.0, 1.0]] and t["times"] == pytest.approx([0.0, 0.1, 0.2])
    assert t["busy_share"] == {"engine/hf": 0.75, "trainer/p": pytest.approx(1 / 3)}
    assert t["gauges"] == {
        "cpu/driver": {"group": "cores", "values": [1.5, 1.0, 0.5]},
        "rollout/queued_groups": {"group": "queues", "values": [2, 3, 4]},
    }
    assert t["steps"] == [{"step": 1, "start": pytest.approx(0.1), "end": pytest.approx(0.3)}]
    with (run / "timeline" / "driver.1.jsonl").open("a") as f:  # the half-written line ends; the run goes on
        f.write('sy": {"engine/hf": [103, [0.25]]}, "gauges": {}}\n')
    t = client.get("/api/runs/0/timeline").json()
    assert t["busy"][0] == [1.0, 0.5, 0.0, 0.25]  # bin 102: between recorded bins, idle (the reader's rule)


def test_an_unreadable_timeline_is_said_so_not_a_5xx(client, run):
    write_timeline(run, '{"k": "bins", "busy": {}}\n')  # a whole line without its bin width
    t = client.get("/api/runs/0/timeline").json()
    assert not t["available"] and t["why"].startswith("rl's timeline is unreadable: KeyError")


@pytest.mark.process
def test_a_port_in_use_is_a_one_line_error(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["dashboard", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"areal-agents dashboard: error: cannot listen on 127.0.0.1:{port} (Address already in use): " + (
        "pass another --port or --host"
    )


def test_a_corrupt_event_file_leaves_the_scalars_read_so_far(client, run):
    (run / "tensorboard" / "events.out.tfevents.9999999999.host.1.0").write_bytes(b"\x00garbage" * 100)
    response = client.get("/api/runs/0/scalars")
    assert response.status_code == 200, response.text
    assert response.json()["tags"]["rollout/reward_mean"]["values"][:2] == [0.25, 0.5]
