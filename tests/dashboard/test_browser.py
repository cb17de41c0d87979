"""The dashboard as a user sees it: `areal-agents dashboard` as a real process on a run that trains while headless
Chromium (Debian's chromium and chromium-driver, driven by selenium) watches it. The curves and a trajectory
must show the run's own numbers (its TensorBoard scalars, its dumped trajectories); screenshots are saved under
the test's tmp_path."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from areal_agents.cli import main
from areal_agents.dashboard.timeline_panel import GAUGE_BINS, HEATMAP_BINS, values
from areal_agents.models import load_tokenizer
from areal_agents.net import free_port, log_tail, wait_healthy
from areal_agents.timeline import read_timeline
from areal_agents.timeline.heatmap import row_order
from areal_agents.types import Trajectory

pytestmark = [pytest.mark.process, pytest.mark.slow]

STEPS = 3
# Two turns; each turn's reward is the share of letters in the reply: rewards that differ between episodes and
# turns even from an untrained model, so a number shown wrongly cannot pass for a right one.
LETTERS_ENV = """
from areal_agents.envs import TextEnv


class Letters(TextEnv):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turn = 0
        return f"Write {int(self.np_random.integers(1, 10))} letters:", {}

    def step(self, action):
        self.turn += 1
        reward = round(sum(c.isalpha() for c in action) / max(len(action), 1), 3)
        return "More letters:", reward, self.turn >= 2, False, {"answer": action}
"""
# Panels whose every trace is checked against the run's TensorBoard series.
PANELS = ("reward", "reward-turn", "accuracy", "staleness", "throughput", "queues")


def chromium() -> webdriver.Chrome:
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert browser and driver, "the browser test needs Debian's chromium and chromium-driver (scripts/setup.sh)"
    options = Options()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(driver))  # the driver named: nothing downloaded


@pytest.fixture
def dashboard(tmp_path):
    """`areal-agents dashboard RUN OTHER` as a process: RUN an empty run directory, OTHER a finished run's
    scalars (written here), side by side; (url, RUN)."""
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    with SummaryWriter(log_dir=str(other / "tensorboard")) as w:
        for step in range(1, 5):
            w.add_scalar("rollout/reward_mean", step / 10, step)
            w.add_scalar("eval/accuracy", step / 8, step)
    port, log = free_port(), tmp_path / "dashboard.log"
    cmd = [sys.executable, "-m", "areal_agents.cli", "dashboard", str(run), str(other), "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_healthy(url, 60, alive=lambda: proc.poll() is None), log_tail(log)
        yield url, run
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def browser():
    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


def train(tmp_path, tiny_dir, run, monkeypatch) -> None:
    (tmp_path / "letters_env.py").write_text(LETTERS_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "rl.yaml"
    config.write_text(
        f"run_dir: {run}\nsteps: {STEPS}\nmodel: {{path: {tiny_dir}}}\n"
        "env: {id: 'letters_env:Letters', kwargs: {}}\neval: {num_problems: 3, every: 1, env_kwargs: {}}\n"
        "rollout: {batch_size: 2, group_size: 4, max_new_tokens: 5, dump_trajectories: true}\n"
        "ppo: {filter_zero_variance_groups: false}\n"
    )
    assert main(["train", str(config), "--no-progress"]) == 0


def whole_page(driver, path) -> None:
    """A screenshot of the whole page: the window grown to its height (an element's screenshot is cut to it)."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1500, height + 140)  # + the window's own frame
    driver.save_screenshot(str(path))


def wait_for(driver, what, timeout=60):
    """``what(driver)`` once it is truthy; on timeout, the page's state in the error."""
    try:
        wait = WebDriverWait(driver, timeout, poll_frequency=0.25, ignored_exceptions=[StaleElementReferenceException])
        return wait.until(lambda d: what(d))
    except TimeoutException:
        state = driver.execute_script("return document.getElementById('updated').textContent")
        raise AssertionError(f"the page never got there ({state}); browser log: {driver.get_log('browser')}") from None


def click(driver, css: str) -> bool:
    """Click the element; False while there is none (a stale one raises, and `wait_for` tries again)."""
    found = driver.find_elements(By.CSS_SELECTOR, css)
    if found:
        found[0].click()
    return bool(found)


def plotted(driver, panel: str) -> list[dict]:
    """The traces plotly drew in a panel: their run, tag, x, y, and how many SVG traces it rendered."""
    return driver.execute_script(
        "const el = document.getElementById('panel-' + arguments[0]);"
        "if (!el || !el.data) return {traces: [], drawn: 0};"
        "return {traces: el.data.map(t => ({run: t.meta.run, tag: t.meta.tag, x: t.x, y: t.y, colour: t.line.color})),"
        "drawn: el.querySelectorAll('.scatterlayer .trace').length};",
        panel,
    )


def check_curves(driver, runs) -> int:
    """Every trace of the checked panels is its run's TensorBoard series; the latest readouts are their last
    values; the two runs are overlaid in their own colours. Returns how many series were compared."""
    scalars = [EventAccumulator(str(r / "tensorboard"), size_guidance={"scalars": 0}).Reload() for r in runs]
    compared = 0
    for panel in PANELS:
        shown = plotted(driver, panel)
        assert shown["traces"] and shown["drawn"] == len(shown["traces"]), (panel, shown)
        for trace in shown["traces"]:
            events = scalars[trace["run"]].Scalars(trace["tag"])
            assert trace["x"] == [e.step for e in events], trace["tag"]
            assert trace["y"] == pytest.approx([e.value for e in events], rel=1e-6), trace["tag"]
            where = f'#latest-{panel} [data-run="{trace["run"]}"][data-tag="{trace["tag"]}"]'
            latest = driver.find_element(By.CSS_SELECTOR, where)
            assert int(latest.get_attribute("data-step")) == events[-1].step
            assert float(latest.get_attribute("data-value")) == pytest.approx(events[-1].value, rel=1e-6)
            compared += 1
    tags = {t["tag"] for t in plotted(driver, "reward-turn")["traces"]}
    assert tags == {"rollout/reward_turn/1", "rollout/reward_turn/2"}
    reward = {(t["run"], t["tag"]): t["colour"] for t in plotted(driver, "reward")["traces"]}
    assert {run for run, _ in reward} == {0, 1}  # side by side
    assert reward[0, "rollout/reward_mean"] != reward[1, "rollout/reward_mean"]  # each run in its colour
    return compared


def expected_timeline(run) -> dict:
    """The run's timeline, read here: each worker's busy row and each queue gauge, as the page should draw them."""
    tl = read_timeline(run)
    assert {"engine/hf", "trainer/policy"} <= set(tl.busy) and "rollout/queued_groups" in tl.gauges
    heat, lines = tl.coarse(HEATMAP_BINS), tl.coarse(GAUGE_BINS)
    queues = {k: values(v) for k, v in lines.gauges.items() if not k.startswith("cpu/") and "memory" not in k}
    workers = row_order(list(heat.busy))
    return {"workers": workers, "z": [values(heat.busy[w]) for w in workers], "drawn": 1, "queues": queues}


def shown_timeline(driver) -> dict:
    """What the heatmap and the queue panel hold, and whether the heatmap's image was drawn."""
    return driver.execute_script(
        "const h = document.getElementById('panel-heatmap'), g = document.getElementById('panel-gauges');"
        "if (!h.data || !g.data) return null;"
        "return {workers: h.data[0].meta.workers, z: h.data[0].z, drawn: h.querySelectorAll('.hm image').length,"
        "queues: Object.fromEntries(g.data.map(t => [t.meta.gauge, t.y]))};"
    )


def check_episode(driver, row, tokenizer) -> None:
    """The viewer shows the dumped row: its reward, per-turn rewards, decoded tokens and loss mask."""
    reward = driver.find_element(By.ID, "ep-reward")
    assert float(reward.get_attribute("data-value")) == pytest.approx(row["reward"])
    badges = [b.text for b in driver.find_elements(By.CSS_SELECTOR, "#episode .head .badge")]
    for k, r in enumerate(row["turn_rewards"]):
        assert f"turn {k + 1}: {float(f'{r:.4g}'):g}" in badges, badges
    text = driver.execute_script("return document.getElementById('ep-tokens').querySelectorAll('.text')")
    shown = "".join(t.get_attribute("textContent") for t in text)
    assert shown == tokenizer.decode(row["input_ids"], skip_special_tokens=False)
    assert colours(driver, "mask").count(GENERATED) == sum(row["loss_mask"])  # by loss mask: generated in green
    assert len(colours(driver, "logprob")) == sum(row["loss_mask"])  # by logprob: only generated tokens coloured


GENERATED = "rgb(187, 247, 208)"  # dashboard.js: #bbf7d0


def colours(driver, mode: str) -> list[str]:
    """The background colours of the episode's tokens (those that have one) with tokens coloured by ``mode``."""
    driver.find_element(By.CSS_SELECTOR, f'input[name="colour-by"][value="{mode}"]').click()
    return driver.execute_script(
        "return [...document.querySelectorAll('#ep-tokens .tok')].map(t => t.style.background).filter(c => c)"
    )


def test_the_dashboard_follows_a_training_run_in_chromium(tmp_path, tiny_dir, dashboard, browser, monkeypatch):
    url, run = dashboard
    browser.get(url)
    wait_for(browser, lambda d: [t["run"] for t in plotted(d, "reward")["traces"]] == [1])  # the other run's

    train(tmp_path, tiny_dir, run, monkeypatch)  # while the page is open: it must pick the steps up itself
    last = f'#latest-reward [data-run="0"][data-tag="rollout/reward_mean"][data-step="{STEPS}"]'
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, last))
    wait_for(browser, lambda d: "finished" in d.find_element(By.ID, "runs").text)
    assert check_curves(browser, [run, tmp_path / "other"]) >= 12
    wait_for(browser, lambda d: shown_timeline(d) == expected_timeline(run))  # the heatmap and queues: the run's
    whole_page(browser, tmp_path / "dashboard.png")

    rows = [json.loads(line) for line in (run / "trajectories" / f"step_{STEPS}.jsonl").read_text().splitlines()]
    wait_for(browser, lambda d: Select(d.find_element(By.ID, "t-step")).first_selected_option.text == str(STEPS))
    pick = max(range(len(rows)), key=lambda i: (rows[i]["reward"], i))  # the best episode of the last step
    wait_for(browser, lambda d: click(d, f'#episodes tr[data-index="{pick}"]'))  # retried if the poll redrew it
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'#episode[data-key="0/trajectories/{STEPS}/{pick}"]'))
    tokenizer = load_tokenizer(tiny_dir)
    check_episode(browser, rows[pick], tokenizer)
    whole_page(browser, tmp_path / "page-with-trajectory.png")
    browser.find_element(By.ID, "trajectories").screenshot(str(tmp_path / "trajectory.png"))

    # The run's held-out eval samples (RUN/eval_samples, in the trajectories' row format), its last step's.
    samples = [json.loads(line) for line in (run / "eval_samples" / f"step_{STEPS}.jsonl").read_text().splitlines()]
    Select(browser.find_element(By.ID, "t-kind")).select_by_value("eval_samples")
    wait_for(browser, lambda d: Select(d.find_element(By.ID, "t-step")).first_selected_option.text == str(STEPS))
    wait_for(browser, lambda d: click(d, '#episodes tr[data-index="1"]'))
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'#episode[data-key="0/eval_samples/{STEPS}/1"]'))
    check_episode(browser, samples[1], tokenizer)

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_the_viewer_shows_tool_calls_parse_failures_and_a_rewritten_history(tiny_dir, dashboard, browser):
    """A step written by hand, as a tool agent's dump looks: an episode in two segments (its template rewrote
    history) with a well-formed and a malformed tool call, and a plain episode. The filter, the flags, the
    generations' numbering across segments and the messages' tool call are the dump's."""
    url, run = dashboard
    tok = load_tokenizer(tiny_dir)
    (run / "config.json").write_text(json.dumps({"model": {"path": str(tiny_dir)}}))
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "<tool_call>{oops"},
    ]
    meta = {"num_segments": 2, "tool_calls": 1, "tool_parse_failures": 1, "stop_reasons": ["tool_calls", "stop"]}
    rows = [
        row(tok, [("1+2=", 0), ("call", 1)], "e0", segment=0, messages=messages[:2], **meta),
        row(tok, [("1+2= call 3", 0), ("<tool_call>{oops", 1)], "e0", segment=1, messages=messages, **meta),
        row(tok, [("2+2=", 0), ("4", 1)], "e1", agent="checker", segment=0, num_segments=1, stop_reasons=["stop"]),
    ]
    (run / "trajectories").mkdir()
    (run / "trajectories" / "step_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    browser.get(url)
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#episode[data-key="0/trajectories/1/0"]'))
    flags = browser.find_element(By.CSS_SELECTOR, '#episodes tr[data-index="0"]').text
    assert "1 parse failure" in flags and "1 call" in flags and "seg 1/2" in flags

    Select(browser.find_element(By.ID, "f-agent")).select_by_value("checker")
    wait_for(browser, lambda d: listed(d) == ["2"])
    Select(browser.find_element(By.ID, "f-agent")).select_by_value("")
    Select(browser.find_element(By.ID, "f-failed")).select_by_value("false")
    wait_for(browser, lambda d: listed(d) == ["2"])
    Select(browser.find_element(By.ID, "f-failed")).select_by_value("true")
    wait_for(browser, lambda d: listed(d) == ["0", "1"])
    wait_for(browser, lambda d: click(d, '#episodes tr[data-index="1"]'))
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#episode[data-key="0/trajectories/1/1"]'))
    head = browser.find_element(By.CSS_SELECTOR, "#episode .head").text
    assert "segment 2 of 2" in head and "1 tool-call parse failure(s)" in head
    labels = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#ep-tokens .span.gen .label")]
    assert labels == ["generation 2\nstop: stop"]  # the episode's second generation: the first is segment 1's
    assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".msg .call")] == [
        'tool call: {"name":"add","arguments":"{\\"a\\": 1, \\"b\\": 2}"}'
    ]
    assert [e.text.split("\n")[0] for e in browser.find_elements(By.CSS_SELECTOR, ".msg .role")] == [
        "user", "assistant", "tool", "assistant"
    ]  # fmt: skip


def listed(driver) -> list[str]:
    """The rows (their indices) the episode table lists."""
    return driver.execute_script("return [...document.querySelectorAll('#episodes tr.row')].map(r => r.dataset.index)")


def row(tokenizer, parts, episode, agent="agent", **metadata) -> dict:
    """A dumped trajectory (``dataclasses.asdict(Trajectory)``) from (text, generated) parts."""
    ids, mask = [], []
    for text, generated in parts:
        new = tokenizer.encode(text, add_special_tokens=False)
        ids, mask = ids + new, mask + [generated] * len(new)
    trajectory = Trajectory(
        ids, mask, [-0.5 * m for m in mask], [m - 1 for m in mask], 1.0, [1.0], "g", agent, episode, metadata
    )
    return dataclasses.asdict(trajectory)
