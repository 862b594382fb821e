// ExperimentView and EvidenceView front-end (metaclaw/notebook/experiment_view.py). The model's
// "view" says which one to draw. Everything shown comes from the synced traitlets; choices go
// back with model.set + save_changes: variant, sort, offset, selected, follow, trace_requests,
// refresh_requests, propose_requests.

// h(): widgets/common.js, put before this module (metaclaw/notebook/widgets/base.py esm)

function send(model, key, value) {
  model.set(key, value);
  model.save_changes();
}

function bump(model, key) {
  send(model, key, (model.get(key) || 0) + 1);
}

function num(value, digits = 2) {
  if (value === null || value === undefined) return "—";
  return (value > 0 ? "+" : "") + Number(value).toFixed(digits);
}

function pct(value) {
  return value === null || value === undefined ? "—" : `${Math.round(value * 100)}%`;
}

function pValue(value) {
  if (value === null || value === undefined) return "—";
  return value < 0.001 ? "< 0.001" : Number(value).toPrecision(3);
}

function signClass(value) {
  if (value === null || value === undefined || value === 0) return "mc-reward";
  return value > 0 ? "mc-reward mc-good" : "mc-reward mc-bad";
}

function verdictCell(result) {
  if (!result) return h("td", { class: "mc-muted" }, "not run");
  if (result.score === null || result.score === undefined) {
    return h("td", { class: "mc-bad", title: result.error || "" }, result.upstream_failed ? "upstream failed" : "not judged");
  }
  return h("td", {},
    h("span", { class: `mc-badge mc-verdict-${result.verdict}` }, result.verdict), " ",
    h("span", { class: signClass(result.score) }, num(result.score, result.score % 1 === 0 ? 0 : 2)));
}

function formatTime(seconds) {
  if (!seconds) return "";
  return new Date(seconds * 1000).toLocaleString();
}

// The trace view of a case: a child widget, drawn by the widget manager where the front-end has
// one (JupyterLab, Notebook 7, VS Code); elsewhere the line says how to show it from Python.
async function drawTrace(model, slot) {
  const ref = model.get("trace");
  if (!ref) {
    slot.replaceChildren();
    return;
  }
  const manager = model.widget_manager;
  if (!manager || !manager.get_model || !manager.create_view) {
    slot.replaceChildren(h("div", { class: "mc-muted" }, "The trace view opened: show it with view.trace in a cell."));
    return;
  }
  try {
    const child = await manager.get_model(String(ref).replace(/^IPY_MODEL_/, ""));
    const view = await manager.create_view(child);
    slot.replaceChildren(h("div", { class: "mc-subtitle" }, "Trace view"), view.el);
  } catch (error) {
    slot.replaceChildren(h("div", { class: "mc-muted" }, `The trace view opened: show it with view.trace in a cell (${error}).`));
  }
}

// A tool call: its name, and its JSON arguments parsed and indented where they parse.
function toolCall(call) {
  const fn = (call && call.function) || {};
  let args = fn.arguments;
  if (typeof args === "string") {
    try {
      args = JSON.parse(args);
    } catch (error) {
      // shown as the text it is
    }
  }
  const text = typeof args === "string" ? args : JSON.stringify(args, null, 2);
  return h("div", { class: "mc-exp-call" },
    h("div", { class: "mc-role" }, `tool call ${fn.name || "?"}`),
    h("pre", { class: "mc-pre mc-exp-text" }, text));
}

function caseDetail(model, detail) {
  const panel = h("div", { class: "mc-detail" },
    h("div", { class: "mc-toolbar" },
      h("span", { class: "mc-title" }, `Case: turn #${detail.turn_id}`),
      h("span", { class: "mc-muted" }, `session ${detail.session_id} · recorded reward ${num(detail.recorded_reward, 0)}` +
        (detail.human_label ? ` · human label ${detail.human_label}` : "")),
      h("button", { class: "mc-button", onclick: () => bump(model, "trace_requests") }, "open in trace view"),
      h("button", { class: "mc-button", onclick: () => send(model, "selected", null) }, "close")));
  panel.append(h("div", { class: "mc-subtitle" }, "Task"), h("pre", { class: "mc-pre" }, detail.task || "(no user message)"));
  const grid = h("div", { class: "mc-exp-replies" });
  for (const v of detail.variants || []) {
    const box = h("div", { class: "mc-exp-reply" }, h("div", { class: "mc-subtitle" }, v.variant));
    if (!v.run) {
      box.append(h("div", { class: "mc-muted" }, "not run yet"));
    } else {
      box.append(h("div", {},
        v.verdict ? h("span", { class: `mc-badge mc-verdict-${v.verdict}` }, v.verdict) : h("span", { class: "mc-bad" }, "no verdict"),
        " ", h("span", { class: signClass(v.score) }, num(v.score)),
        h("span", { class: "mc-muted" }, ` · skills: ${(v.skills || []).join(", ") || "none"}` +
          (v.latency_ms !== null && v.latency_ms !== undefined ? ` · ${Math.round(v.latency_ms)} ms` : "") +
          (v.label_similarity !== null && v.label_similarity !== undefined ? ` · similarity to the corrected answer ${v.label_similarity.toFixed(2)}` : ""))));
      if (v.error) box.append(h("div", { class: "mc-error" }, v.error));
      if (v.reply) box.append(h("pre", { class: "mc-pre mc-exp-text" }, v.reply));
      for (const call of v.tool_calls || []) box.append(toolCall(call));
      if (v.votes && v.votes.length) box.append(h("div", { class: "mc-muted" }, `judge votes: ${v.votes.map((s) => num(s, 0)).join(", ")}`));
    }
    grid.append(box);
  }
  panel.append(grid);
  return panel;
}

function renderExperiment(model, el) {
  el.classList.add("metaclaw-experiment");
  const follow = h("input", { type: "checkbox", onchange: (e) => send(model, "follow", e.target.checked) });
  const toolbar = h("div", { class: "mc-toolbar" });
  const pin = h("div", { class: "mc-pin" });
  const content = h("div", {});
  const traceSlot = h("div", {});
  el.replaceChildren(toolbar, pin, content, traceSlot);

  const drawToolbar = () => {
    const names = model.get("experiments") || [];
    const variants = model.get("variants") || [];
    const nameSelect = h("select", { class: "mc-select", "aria-label": "experiment", onchange: (e) => send(model, "name", e.target.value) },
      names.map((n) => h("option", { value: n, selected: n === model.get("name") }, n)));
    const variantSelect = h("select", { class: "mc-select", "aria-label": "variant", onchange: (e) => send(model, "variant", e.target.value) },
      variants.slice(1).map((v) => h("option", { value: v, selected: v === model.get("variant") }, v)));
    const sortSelect = h("select", { class: "mc-select", "aria-label": "sort", onchange: (e) => send(model, "sort", e.target.value) },
      [["turn", "by turn"], ["difference", "biggest difference first"]].map(([v, t]) => h("option", { value: v, selected: v === model.get("sort") }, t)));
    follow.checked = !!model.get("follow");
    toolbar.replaceChildren(
      h("span", { class: "mc-title" }, "Experiment"), nameSelect,
      h("label", {}, "compare ", variantSelect, ` with ${variants[0] || "—"}`),
      h("label", {}, "sort ", sortSelect),
      h("label", { title: "re-read the experiment as new results are stored" }, follow, " follow"),
      h("button", { class: "mc-button", onclick: () => bump(model, "refresh_requests") }, "refresh"));
    pin.className = model.get("follow") ? "mc-pin mc-following" : "mc-pin mc-muted";
    pin.replaceChildren((model.get("follow") ? "following the experiment: new results show as they are stored"
      : `pinned: results as of ${formatTime(model.get("taken_at"))}; refresh (or follow) reads newer ones`) +
      ` · dataset ${model.get("dataset")} · ${model.get("plan") || ""}`);
  };

  const draw = () => {
    const variants = model.get("variants") || [];
    const first = variants[0] || "";
    const picked = model.get("variant");
    const summary = model.get("summary") || [];
    const rows = model.get("rows") || [];
    const selected = model.get("selected");
    const detail = model.get("detail") || {};
    const error = model.get("error") || "";
    const parts = [];
    if (error) parts.push(h("div", { class: "mc-error" }, error));

    const sumTable = h("table", { class: "mc-table mc-exp-summary" },
      h("thead", {}, h("tr", {}, ["variant", "cases", "scored", "mean reward", "pass rate", `difference vs ${first}`, "95% interval (paired bootstrap)", "McNemar p"].map((c) => h("th", {}, c)))));
    const sumBody = h("tbody");
    for (const s of summary) {
      sumBody.append(h("tr", { class: s.variant === picked ? "mc-exp-picked" : "" },
        h("td", {}, h("b", {}, s.variant), s.variant === first ? h("span", { class: "mc-muted" }, " (baseline)") : ""),
        h("td", {}, s.cases), h("td", {}, s.scored),
        h("td", { class: signClass(s.mean_reward) }, num(s.mean_reward)), h("td", {}, pct(s.pass_rate)),
        h("td", { class: signClass(s.diff_vs_first) }, num(s.diff_vs_first)),
        h("td", {}, s.diff_low === null || s.diff_low === undefined ? "—" : `${num(s.diff_low)} to ${num(s.diff_high)}`),
        h("td", {}, pValue(s.mcnemar_p))));
    }
    sumTable.append(sumBody);
    parts.push(sumTable);

    const total = model.get("total") || 0;
    const offset = model.get("offset") || 0;
    const size = model.get("page_size") || 50;
    const table = h("table", { class: "mc-table" },
      h("thead", {}, h("tr", {}, ["case", "task", ...variants, `${picked} − ${first}`].map((c) => h("th", {}, c)))));
    const body = h("tbody");
    for (const row of rows) {
      body.append(h("tr", {
        class: row.turn_id === selected ? "mc-row mc-selected" : "mc-row",
        title: "show this case's replies",
        onclick: () => send(model, "selected", row.turn_id),
      },
        h("td", {}, `#${row.turn_id}`),
        h("td", { class: "mc-task" }, row.task || ""),
        variants.map((v) => verdictCell((row.by || {})[v])),
        h("td", { class: signClass(row.difference) }, num(row.difference))));
    }
    table.append(body);
    parts.push(h("div", { class: "mc-toolbar" },
      h("span", { class: "mc-muted" }, total ? `cases ${offset + 1}–${Math.min(offset + size, total)} of ${total}` : "no cases"),
      h("button", { class: "mc-button", disabled: offset <= 0, onclick: () => send(model, "offset", Math.max(0, offset - size)) }, "◀ previous"),
      h("button", { class: "mc-button", disabled: offset + size >= total, onclick: () => send(model, "offset", offset + size) }, "next ▶")));
    parts.push(rows.length ? h("div", { class: "mc-scroll" }, table) : h("div", { class: "mc-muted" }, "No cases."));
    if (selected !== null && selected !== undefined && detail && detail.turn_id === selected) parts.push(caseDetail(model, detail));
    content.replaceChildren(...parts);
  };

  const toolbarEvents = ["change:experiments", "change:name", "change:variants", "change:variant", "change:sort", "change:follow", "change:taken_at", "change:plan", "change:dataset"];
  const events = ["change:summary", "change:rows", "change:selected", "change:detail", "change:error", "change:variant", "change:offset", "change:total"];
  const onTrace = () => drawTrace(model, traceSlot);
  for (const name of toolbarEvents) model.on(name, drawToolbar);
  for (const name of events) model.on(name, draw);
  model.on("change:trace", onTrace);
  drawToolbar();
  draw();
  onTrace();
  return () => {
    for (const name of toolbarEvents) model.off(name, drawToolbar);
    for (const name of events) model.off(name, draw);
    model.off("change:trace", onTrace);
  };
}

function renderEvidence(model, el) {
  el.classList.add("metaclaw-evidence");
  const draw = () => {
    const rows = model.get("rows") || [];
    const suggestions = model.get("suggestions") || [];
    const parts = [h("div", { class: "mc-toolbar" },
      h("span", { class: "mc-title" }, "Per-skill evidence"),
      h("span", { class: "mc-muted" }, `skill generation ${model.get("generation")} · ${rows.length} skills · as of ${formatTime(model.get("taken_at"))}`),
      h("button", { class: "mc-button", onclick: () => bump(model, "refresh_requests") }, "refresh"))];
    parts.push(h("div", { class: "mc-muted mc-exp-note" },
      "Observational: the turns that got a skill against comparable turns (whose ask it matches) that did not. " +
      "They differ in time, generation and task too; an experiment that replays the same turns answers the causal question."));
    if (model.get("error")) parts.push(h("div", { class: "mc-error" }, model.get("error")));
    const table = h("table", { class: "mc-table" },
      h("thead", {}, h("tr", {}, ["skill", "counted since", "injected", "reward with (judged / sessions)", "comparable without (judged / sessions)", "difference (95% interval)", "labels pass / fail", "last used", "nearest skill", "suggestion"].map((c) => h("th", {}, c)))));
    const body = h("tbody");
    for (const r of rows) {
      body.append(h("tr", {},
        h("td", {}, h("b", {}, r.skill), r.in_library ? "" : h("span", { class: "mc-muted" }, " (removed)")),
        h("td", { class: "mc-muted", title: "the turns counted on both sides are from then on: the skill's current version" }, formatTime(r.counted_since) || "—"),
        h("td", {}, r.injected),
        h("td", { class: signClass(r.reward_with) }, `${num(r.reward_with)} (${r.judged_with} / ${r.sessions_with})`),
        h("td", { class: signClass(r.reward_without) }, `${num(r.reward_without)} (${r.judged_without == null ? "—" : `${r.judged_without} / ${r.sessions_without}`})`),
        h("td", { class: signClass(r.reward_delta) }, num(r.reward_delta) + (r.delta_low === null || r.delta_low === undefined ? "" : ` (${num(r.delta_low)} to ${num(r.delta_high)})`)),
        h("td", {}, `${r.labels_pass_with} / ${r.labels_fail_with}`),
        h("td", { class: "mc-muted" }, formatTime(r.last_used) || "never"),
        h("td", {}, r.nearest ? `${r.nearest} (${Number(r.nearest_cosine).toFixed(2)})` : "—"),
        h("td", {}, r.suggestion ? h("span", { class: `mc-badge mc-exp-${r.suggestion}` }, r.suggestion) : "")));
    }
    table.append(body);
    parts.push(rows.length ? h("div", { class: "mc-scroll" }, table) : h("div", { class: "mc-muted" }, "No skills yet."));
    if (suggestions.length) {
      parts.push(h("div", { class: "mc-subtitle" }, "Suggestions (applied only as proposals you review)"),
        h("ul", {}, suggestions.map((s) => h("li", {}, s.reason))),
        h("button", { class: "mc-button", onclick: () => bump(model, "propose_requests") }, "file them as held proposals"));
    } else {
      parts.push(h("div", { class: "mc-muted" }, "No suggestion to retire, merge or review a skill."));
    }
    if (model.get("message")) parts.push(h("div", { class: "mc-good" }, model.get("message")));
    el.replaceChildren(...parts);
  };
  const events = ["change:rows", "change:suggestions", "change:generation", "change:message", "change:error", "change:taken_at"];
  for (const name of events) model.on(name, draw);
  draw();
  return () => {
    for (const name of events) model.off(name, draw);
  };
}

function render({ model, el }) {
  el.classList.add("metaclaw-w");
  return model.get("view") === "evidence" ? renderEvidence(model, el) : renderExperiment(model, el);
}

export default { render };
