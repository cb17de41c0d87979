// areal-agents dashboard: curves from each run's TensorBoard scalars, the workers' timeline, the trajectory viewer.
// Everything comes from this server's /api (no network beyond it); polls while "live" is ticked.
"use strict";

const RUN_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"];
const POLL_MS = 3000;
const PLOT_CONFIG = { displayModeBar: false, responsive: true };  // drag to zoom, double-click to reset

// One panel per question a run answers; `match` picks tags by prefix (several series) or exact name.
const PANELS = [
  { id: "reward", title: "Reward (batch mean) and sampled accuracy", tags: ["rollout/reward_mean", "rollout/accuracy"] },
  { id: "reward-turn", title: "Reward per turn", prefix: "rollout/reward_turn/" },
  { id: "reward-agent", title: "Reward per agent", prefix: "rollout/reward_agent/" },
  { id: "accuracy", title: "Held-out greedy accuracy", tags: ["eval/accuracy"], markers: true, percent: true },
  { id: "staleness", title: "Staleness of trained samples (versions behind)", tags: ["rollout/staleness_mean", "rollout/staleness_max"] },
  { id: "throughput", title: "Throughput", tags: ["perf/gen_tokens_per_s", "perf/trained_samples_per_s"], twin: true },
  { id: "queues", title: "Queues at step end", tags: ["rollout/queued_groups", "rollout/running_groups", "rollout/episodes_running"] },
  { id: "time", title: "Where a step's time went (s)", tags: ["perf/step_seconds", "perf/rollout_wait_seconds", "perf/weight_sync_seconds"] },
  { id: "episodes", title: "Episodes: truncated share, parse failures, failed", tags: ["rollout/truncated_fraction", "rollout/tool_parse_failures", "rollout/episodes_failed"] },
  { id: "engine", title: "Engines and GPUs", tags: ["engine/busy_fraction"], regex: /^perf\/gpu\d+_utilisation$/ },
];

const state = { runs: [], scalars: {}, timer: null, episode: null, colourBy: "mask", lastSelection: null };

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const fmt = (v) => (v === null || v === undefined ? "–" : Math.abs(v) >= 1000 ? v.toFixed(0) : Number(v.toPrecision(4)).toString());
const runColour = (i) => RUN_COLOURS[i % RUN_COLOURS.length];

async function getJSON(url) {
  const r = await fetch(url);
  const body = await r.json().catch(() => ({ detail: r.statusText }));
  if (!r.ok) throw new Error(body.detail || r.statusText);
  return body;
}

// ---- curves -------------------------------------------------------------------------------------------------

function panelTags(panel, tags) {
  let out = (panel.tags || []).filter((t) => tags.has(t));
  if (panel.prefix) out = out.concat([...tags].filter((t) => t.startsWith(panel.prefix)).sort());
  if (panel.regex) out = out.concat([...tags].filter((t) => panel.regex.test(t)).sort());
  return out;
}

function ensurePanel(panel) {
  let box = $("box-" + panel.id);
  if (!box) {
    box = document.createElement("div");
    box.className = "panel";
    box.id = "box-" + panel.id;
    box.innerHTML = `<h3>${esc(panel.title)}</h3><div class="latest" id="latest-${panel.id}"></div><div class="chart" id="panel-${panel.id}"></div>`;
    $("panels").appendChild(box);
  }
  return box;
}

// Steps are whole: a short run gets a tick per step, not 1.5 and 2.5.
function integerTicks(traces) {
  const xs = traces.flatMap((t) => t.x);
  return Math.max(...xs) - Math.min(...xs) <= 12 ? { dtick: 1 } : { tickformat: "d" };
}

function drawPanel(panel, allTags) {
  const multi = state.runs.length > 1;
  const traces = [], latest = [];
  state.runs.forEach((run) => {
    const series = state.scalars[run.index] || {};
    panelTags(panel, allTags).forEach((tag, k) => {
      const s = series[tag];
      if (!s || !s.steps.length) return;
      const short = panel.prefix ? tag.slice(panel.prefix.length) : tag.split("/").pop();
      const name = multi ? `${run.name} · ${short}` : short;
      const second = panel.twin && k === 1;
      traces.push({
        x: s.steps, y: s.values, name, type: "scatter",
        mode: panel.markers || s.steps.length < 3 ? "lines+markers" : "lines",
        line: { color: runColour(run.index), dash: DASHES[k % DASHES.length], width: k === 0 ? 2.5 : 1.8 },
        yaxis: second ? "y2" : "y",
        meta: { run: run.index, tag },
      });
      const i = s.steps.length - 1;
      latest.push(`<span data-run="${run.index}" data-tag="${esc(tag)}" data-step="${s.steps[i]}" data-value="${s.values[i]}">` +
        `<b style="color:${runColour(run.index)}">${esc(name)}</b> ${fmt(s.values[i])} <small>@${s.steps[i]}</small></span>`);
    });
  });
  const box = ensurePanel(panel);
  box.classList.toggle("hidden", traces.length === 0);
  if (!traces.length) return;
  $("latest-" + panel.id).innerHTML = latest.join(" ");
  const layout = {
    margin: { l: 50, r: panel.twin ? 55 : 15, t: 8, b: 35 }, uirevision: panel.id,
    legend: { orientation: "h", y: -0.2, font: { size: 10 } }, showlegend: true,
    xaxis: { zeroline: false, ...integerTicks(traces) },
    yaxis: panel.percent ? { tickformat: ".0%", rangemode: "tozero" } : { rangemode: panel.twin ? "tozero" : "normal" },
  };
  if (panel.twin) {
    const [a, b] = panelTags(panel, allTags);
    layout.yaxis.title = { text: (a || "").split("/").pop(), font: { size: 10 } };
    layout.yaxis2 = { overlaying: "y", side: "right", rangemode: "tozero", title: { text: (b || "").split("/").pop(), font: { size: 10 } } };
  }
  Plotly.react("panel-" + panel.id, traces, layout, PLOT_CONFIG);
}

function drawCustom(allTags) {
  const sel = $("custom-tag");
  const have = new Set([...sel.options].map((o) => o.value));
  [...allTags].sort().forEach((t) => { if (!have.has(t)) sel.add(new Option(t, t)); });
  const tag = sel.value;
  $("panel-custom").classList.toggle("hidden", !tag);
  if (!tag) return;
  const traces = state.runs.filter((r) => (state.scalars[r.index] || {})[tag]).map((r) => ({
    x: state.scalars[r.index][tag].steps, y: state.scalars[r.index][tag].values, name: r.name,
    line: { color: runColour(r.index) }, type: "scatter",
  }));
  Plotly.react("panel-custom", traces, { margin: { l: 50, r: 15, t: 25, b: 35 }, title: { text: tag, font: { size: 12 } }, uirevision: tag }, PLOT_CONFIG);
}

async function refreshCurves() {
  await Promise.all(state.runs.map(async (run) => {
    try { state.scalars[run.index] = (await getJSON(`/api/runs/${run.index}/scalars`)).tags; } catch (e) { /* next poll */ }
  }));
  const allTags = new Set();
  Object.values(state.scalars).forEach((s) => Object.keys(s).forEach((t) => allTags.add(t)));
  PANELS.forEach((p) => drawPanel(p, allTags));
  drawCustom(allTags);
  $("curves-note").textContent = allTags.size ? "" : "No TensorBoard scalars yet (the runs have logged no step).";
}

// ---- runs and polling ---------------------------------------------------------------------------------------

function drawRuns() {
  $("runs").innerHTML = state.runs.map((r) =>
    `<span class="run-chip" title="${esc(r.path)}"><span class="dot" style="background:${runColour(r.index)}"></span>` +
    `${esc(r.name)} <span class="state">${r.finished ? "finished" : "running"}</span></span>`).join("");
  ["t-run", "w-run"].forEach((id) => {
    const sel = $(id);
    if (sel.options.length !== state.runs.length) {
      sel.innerHTML = state.runs.map((r) => `<option value="${r.index}">${esc(r.name)}</option>`).join("");
    }
  });
}

function drawSteps() {
  const run = state.runs[Number($("t-run").value)] || state.runs[0];
  if (!run) return false;
  const kind = $("t-kind").value, steps = run.steps[kind] || [];
  const sel = $("t-step"), before = sel.value;
  const had = [...sel.options].map((o) => o.value).join(",");
  if (had !== steps.join(",")) {
    const wasLatest = !before || before === sel.options[sel.options.length - 1]?.value;
    sel.innerHTML = steps.map((s) => `<option value="${s}">${s}</option>`).join("");
    sel.value = wasLatest && steps.length ? String(steps[steps.length - 1]) : before;
  }
  $("t-kind").options[1].disabled = !(run.steps.eval_samples || []).length;
  if (!steps.length) {
    $("t-note").textContent = kind === "trajectories"
      ? `${run.name} has no trajectory dumps yet (train with rollout.dump_trajectories=true).`
      : `${run.name} has no held-out eval samples.`;
  }
  return sel.value !== before;
}

async function refreshRuns() {
  state.runs = await getJSON("/api/runs");
  drawRuns();
  if (drawSteps()) await loadEpisodes();
}

async function tick() {
  try {
    await refreshRuns();
    await refreshCurves();
    await refreshTimeline();
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    $("updated").textContent = "update failed: " + e.message;
  }
  if ($("live").checked) state.timer = setTimeout(tick, POLL_MS);
}

// ---- the workers' timeline (heatmap, queues, bottleneck report) -----------------------------------------------

async function refreshTimeline() {
  const run = state.runs[Number($("w-run").value)] || state.runs[0];
  if (!run) return;
  const t = await getJSON(`/api/runs/${run.index}/timeline`);
  ["panel-heatmap", "panel-gauges"].forEach((id) => $(id).parentElement.classList.toggle("hidden", !t.available));
  if (!t.available) { $("timeline-note").textContent = t.why; $("box-cores").classList.add("hidden"); return; }
  $("timeline-note").textContent = `${t.workers.length} workers over ${fmt(t.seconds)} s; heatmap bins ${fmt(t.heatmap_dt)} s, ` +
    `queues ${fmt(t.gauge_dt)} s` + (t.dropped_spans ? `; ${t.dropped_spans} spans over the file's budget dropped` : "");
  drawHeatmap(t);
  drawGauges(t, "queues", "panel-gauges", "count");
  const other = Object.values(t.gauges).some((g) => g.group !== "queues");
  $("box-cores").classList.toggle("hidden", !other);
  if (other) drawGauges(t, ["cores", "memory"], "panel-cores", "cores busy", "GiB");
  const report = $("bottleneck");
  report.classList.toggle("hidden", !t.bottleneck);
  if (t.bottleneck) report.textContent = typeof t.bottleneck === "string" ? t.bottleneck : JSON.stringify(t.bottleneck, null, 1);
}

// Where each step began: dotted lines over a time axis, labelled with the step at the top.
function stepMarks(t) {
  const every = Math.max(1, Math.ceil(t.steps.length / 15));
  const marks = t.steps.filter((s, i) => i % every === 0);
  return {
    shapes: marks.map((s) => ({ type: "line", xref: "x", yref: "paper", x0: s.start, x1: s.start, y0: 0, y1: 1,
      line: { color: "rgba(0,0,0,0.35)", width: 1, dash: "dot" } })),
    annotations: marks.map((s) => ({ x: s.start, y: 1, xref: "x", yref: "paper", yanchor: "bottom", showarrow: false,
      text: `step ${s.step}`, font: { size: 9, color: "#555" } })),
  };
}

function drawHeatmap(t) {
  const labels = t.workers.map((w) => `${w} (${Math.round(100 * t.busy_share[w])}%)`);
  const trace = {
    type: "heatmap", z: t.busy, x: t.times, y: labels, zmin: 0, zmax: 1, colorscale: "Viridis",
    colorbar: { title: { text: "busy", side: "right" }, tickformat: ".0%", thickness: 12 },
    hovertemplate: "%{y}<br>t = %{x:.1f} s<br>busy %{z:.0%}<extra></extra>", xgap: 0, ygap: 1,
    meta: { workers: t.workers },
  };
  const marks = stepMarks(t);
  Plotly.react("panel-heatmap", [trace], {
    height: 90 + (t.workers.length > 24 ? 14 : 26) * t.workers.length, margin: { l: 190, r: 20, t: 22, b: 40 }, uirevision: "heat",
    xaxis: { title: { text: "seconds since the run's first bin", font: { size: 11 } } },
    yaxis: { autorange: "reversed", automargin: true }, ...marks,
  }, PLOT_CONFIG);
}

function drawGauges(t, groups, id, unit, unit2) {
  groups = [].concat(groups);
  const names = Object.keys(t.gauges).filter((k) => groups.includes(t.gauges[k].group));
  const traces = names.map((k, i) => ({
    x: t.gauge_times, y: t.gauges[k].values, name: k, type: "scatter", mode: "lines", connectgaps: false,
    line: { width: 1.5, shape: "hv", color: RUN_COLOURS[(i + 1) % RUN_COLOURS.length] },
    yaxis: unit2 && t.gauges[k].group === groups[1] ? "y2" : "y", meta: { gauge: k },
  }));
  const layout = {
    margin: { l: 50, r: unit2 ? 55 : 15, t: 22, b: 40 }, uirevision: id, legend: { orientation: "h", y: -0.25, font: { size: 10 } },
    xaxis: { title: { text: "seconds", font: { size: 11 } } }, yaxis: { title: { text: unit, font: { size: 10 } }, rangemode: "tozero" },
    ...stepMarks(t),
  };
  if (unit2) layout.yaxis2 = { overlaying: "y", side: "right", rangemode: "tozero", title: { text: unit2, font: { size: 10 } } };
  Plotly.react(id, traces, layout, PLOT_CONFIG);
}

// ---- the trajectory viewer ----------------------------------------------------------------------------------

function filterQuery() {
  const q = new URLSearchParams();
  const add = (key, id) => { const v = $(id).value; if (v !== "") q.set(key, v); };
  add("agent", "f-agent"); add("truncated", "f-truncated"); add("failed", "f-failed");
  add("min_reward", "f-min"); add("max_reward", "f-max");
  return q.toString();
}

function flags(e) {
  let f = "";
  if (e.truncated) f += '<span class="flag trunc">truncated</span>';
  const n = (k, word) => `${k} ${word}${k === 1 ? "" : "s"}`;
  if (e.tool_parse_failures) f += `<span class="flag fail">${n(e.tool_parse_failures, "parse failure")}</span>`;
  if (e.tool_calls) f += `<span class="flag tool">${n(e.tool_calls, "call")}</span>`;
  if (e.num_segments > 1) f += `<span class="flag seg">seg ${e.segment + 1}/${e.num_segments}</span>`;
  return f;
}

async function loadEpisodes() {
  const run = $("t-run").value, kind = $("t-kind").value, step = $("t-step").value;
  const body = $("episodes").tBodies[0];
  if (step === "") { body.innerHTML = ""; $("episode").innerHTML = ""; return; }
  let data;
  try {
    data = await getJSON(`/api/runs/${run}/${kind}/${step}?${filterQuery()}`);
  } catch (e) { $("t-note").textContent = e.message; body.innerHTML = ""; return; }
  const agentSel = $("f-agent"), chosen = agentSel.value;
  agentSel.innerHTML = '<option value="">any</option>' + data.agents.map((a) => `<option value="${esc(a)}">${esc(a)}</option>`).join("");
  agentSel.value = chosen;
  $("t-note").textContent = `step ${data.step}: ${data.episodes.length} of ${data.total} trajectories shown` +
    (data.partial_lines ? ` (${data.partial_lines} line(s) still being written or unreadable)` : "");
  body.innerHTML = data.episodes.map((e) =>
    `<tr class="row" data-index="${e.index}"><td>${e.index}</td><td>${esc(e.episode_id)}</td><td>${esc(e.agent_id)}</td>` +
    `<td class="reward">${fmt(e.reward)}</td><td>${e.turn_rewards.map(fmt).join(", ")}</td><td>${e.tokens}</td>` +
    `<td>${e.generated}</td><td>${flags(e)}</td></tr>`).join("");
  [...body.rows].forEach((tr) => tr.addEventListener("click", () => loadEpisode(Number(tr.dataset.index))));
  const again = data.episodes.find((e) => state.lastSelection === `${run}/${kind}/${step}/${e.index}`);
  if (again) loadEpisode(again.index);
  else if (data.episodes.length) loadEpisode(data.episodes[0].index);
  else $("episode").innerHTML = '<div class="note">No episode passes the filters.</div>';
}

async function loadEpisode(index) {
  const run = $("t-run").value, kind = $("t-kind").value, step = $("t-step").value;
  state.lastSelection = `${run}/${kind}/${step}/${index}`;
  [...$("episodes").tBodies[0].rows].forEach((tr) => {
    tr.classList.toggle("selected", Number(tr.dataset.index) === index);
    if (Number(tr.dataset.index) === index) {  // in view in the list (the page itself does not jump)
      const list = tr.closest(".episode-list");
      if (tr.offsetTop < list.scrollTop || tr.offsetTop > list.scrollTop + list.clientHeight - 40) {
        list.scrollTop = tr.offsetTop - list.clientHeight / 2;
      }
    }
  });
  const key = `${run}/${kind}/${step}/${index}`;
  try {
    state.episode = await getJSON(`/api/runs/${run}/${kind}/${step}/${index}`);
  } catch (e) { $("episode").innerHTML = `<div class="note warn">${esc(e.message)}</div>`; return; }
  if (state.lastSelection !== key) return;  // another episode was picked while this one loaded
  drawEpisode();
  $("episode").dataset.key = key;  // which episode is shown: run/kind/step/row
}

// Colour of one token under the chosen mode, or "" to leave it plain.
function tokenColour(ep, i, versions) {
  const gen = ep.loss_mask[i] === 1;
  if (state.colourBy === "mask") return gen ? "#bbf7d0" : "#f3f4f6";
  if (!gen) return "";
  if (state.colourBy === "version") {
    const k = versions.indexOf(ep.versions[i]);
    return `hsl(${(k * 137) % 360}, 70%, 82%)`;
  }
  const lp = ep.logprobs[i] ?? 0, p = Math.exp(Math.max(lp, -20));  // probability: red (unlikely) to green (sure)
  return `hsl(${Math.round(120 * p)}, 75%, ${Math.round(78 + 8 * p)}%)`;
}

function legend(ep, versions) {
  if (state.colourBy === "mask") {
    return '<span><span class="sw" style="background:#bbf7d0"></span>generated (loss mask 1)</span>' +
      '<span><span class="sw" style="background:#f3f4f6"></span>read: prompt, env, tools, template (0)</span>';
  }
  if (state.colourBy === "version") {
    return versions.map((v, k) => `<span><span class="sw" style="background:hsl(${(k * 137) % 360}, 70%, 82%)"></span>policy v${v}</span>`).join("");
  }
  return [0.01, 0.1, 0.5, 0.9, 1].map((p) => `<span><span class="sw" style="background:hsl(${Math.round(120 * p)}, 75%, ${Math.round(78 + 8 * p)}%)"></span>p=${p}</span>`).join("") +
    "<span>(probability of the sampled token, exp(logprob))</span>";
}

function drawTokens(ep) {
  const versions = [...new Set(ep.versions.filter((v, i) => ep.loss_mask[i] === 1))].sort((a, b) => a - b);
  // One generation per turn (no tool calls, one segment): each generation's label carries its turn's reward.
  const gens = ep.spans.filter((s) => s.generated).length;
  const perTurn = ep.num_segments === 1 && !ep.tool_calls && ep.turn_rewards.length === gens;
  const html = ep.spans.map((s) => {
    const label = s.generated
      ? `generation ${s.generation + 1}${s.stop_reason ? `<br>stop: ${esc(s.stop_reason)}` : ""}` +
        (perTurn ? `<br>turn reward ${fmt(ep.turn_rewards[s.generation])}` : "")
      : "model read<br><small>prompt, env, template</small>";
    let toks = "";
    for (let i = s.start; i < s.end; i++) {
      const c = tokenColour(ep, i, versions);
      const tip = `#${i} id ${ep.input_ids[i]} · mask ${ep.loss_mask[i]} · version ${ep.versions[i]} · logprob ${fmt(ep.logprobs[i])}`;
      const nl = ep.token_text[i].includes("\n") ? " nl" : "";  // a newline shows as ↵ (CSS: not in the text)
      toks += `<span class="tok${nl}" style="${c ? "background:" + c : ""}" title="${esc(tip)}">${esc(ep.token_text[i])}</span>`;
    }
    return `<div class="span ${s.generated ? "gen" : "read"}"><div class="label">${label}</div><div class="text">${toks}</div></div>`;
  }).join("");
  return { html, legend: legend(ep, versions) };
}

function drawMessages(ep) {
  if (!ep.messages.length) return "";
  const body = ep.messages.map((m) => {
    const calls = (m.tool_calls || []).map((c) => `<span class="call">tool call: ${esc(JSON.stringify(c.function || c))}</span>`).join("");
    const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
    return `<div class="msg ${esc(m.role || "")}"><span class="role">${esc(m.role || "?")}</span>${m.name ? " (" + esc(m.name) + ")" : ""}\n${esc(content || "")}${calls}</div>`;
  }).join("");
  return `<details open><summary>messages, as the agent kept them (${ep.messages.length})</summary>${body}</details>`;
}

function drawEpisode() {
  const ep = state.episode;
  if (!ep) return;
  const turns = ep.turn_rewards.map((r, k) => `<span class="badge">turn ${k + 1}: ${fmt(r)}</span>`).join("");
  const seg = ep.num_segments > 1
    ? `<span class="flag seg">segment ${ep.segment + 1} of ${ep.num_segments}: the chat template rewrote history, so this prompt does not extend the previous segment's tokens</span>` : "";
  const tokens = drawTokens(ep);
  $("episode").innerHTML =
    `<div class="head"><b>episode ${esc(ep.episode_id)}</b><span class="badge">agent ${esc(ep.agent_id)}</span>` +
    `<span class="badge reward" id="ep-reward" data-value="${ep.reward}">reward ${fmt(ep.reward)}</span>${turns}` +
    `<span class="badge">${ep.tokens} tokens, ${ep.generated} generated</span>` +
    `<span class="badge">tool calls ${ep.tool_calls}</span>` +
    (ep.tool_parse_failures ? `<span class="flag fail">${ep.tool_parse_failures} tool-call parse failure(s)</span>` : "") +
    (ep.truncated ? '<span class="flag trunc">truncated</span>' : "") + seg + "</div>" +
    (ep.decoded ? "" : `<div class="note warn">${esc(ep.tokenizer)}: tokens shown as ids</div>`) +
    `<div class="colour-by">colour tokens by ${["mask", "version", "logprob"].map((m) =>
      `<label><input type="radio" name="colour-by" value="${m}" ${state.colourBy === m ? "checked" : ""}> ${m === "mask" ? "loss mask" : m === "version" ? "policy version" : "logprob"}</label>`).join("")}` +
    `<span class="legend">${tokens.legend}</span></div>` +
    `<div class="tokens" id="ep-tokens">${tokens.html}</div>` + drawMessages(ep) +
    `<details><summary>metadata</summary><pre class="meta">${esc(JSON.stringify(ep.metadata, null, 1))}</pre></details>`;
  document.querySelectorAll('input[name="colour-by"]').forEach((r) => r.addEventListener("change", () => { state.colourBy = r.value; drawEpisode(); }));
}

// ---- wiring -------------------------------------------------------------------------------------------------

$("live").addEventListener("change", () => { clearTimeout(state.timer); if ($("live").checked) tick(); });
$("custom-tag").addEventListener("change", () => refreshCurves());
$("w-run").addEventListener("change", () => refreshTimeline());
$("t-run").addEventListener("change", () => { drawSteps(); loadEpisodes(); });
$("t-kind").addEventListener("change", () => { $("t-step").innerHTML = ""; drawSteps(); loadEpisodes(); });
$("t-step").addEventListener("change", loadEpisodes);
["f-agent", "f-truncated", "f-failed", "f-min", "f-max"].forEach((id) => $(id).addEventListener("change", loadEpisodes));
tick();
