// TraceWidget front-end: one session turn by turn. The list shows one page of short previews
// (rows); the detail pane shows the selected turn as the upstream saw it, with the injected skill
// block highlighted, tool calls and results folded, judge votes beside human labels, and the
// skill generation written for a failure. Choices go back with model.set + save_changes:
// selected, session_id, failures_only, offset, step_request, label_request, refresh_requests.

// h(): widgets/common.js, put before this module (metaclaw/notebook/widgets/base.py esm)

function formatScore(value) {
  if (value === null || value === undefined) return "unjudged";
  return (value > 0 ? "+" : "") + Number(value).toFixed(value % 1 === 0 ? 0 : 2);
}

function verdictBadge(label, verdict) {
  if (!verdict) return h("span", { class: "mc-badge mc-muted" }, `${label} —`);
  return h("span", { class: `mc-badge mc-verdict-${verdict}` }, `${label} ${verdict}`);
}

let nonce = 0;
function send(model, key, value) {
  model.set(key, value);
  model.save_changes();
}

function messageView(message) {
  const role = message.role || "?";
  if (role === "tool") {
    return h("details", { class: "mc-msg mc-msg-tool" },
      h("summary", {}, h("span", { class: "mc-role" }, "tool result"),
        h("span", { class: "mc-muted" }, ` ${message.tool_call_id || ""} · ${(message.text || "").length} chars`)),
      h("pre", { class: "mc-pre" }, message.text || ""));
  }
  const box = h("div", { class: `mc-msg mc-msg-${role}` }, h("div", { class: "mc-role" }, role));
  if (message.text) box.append(h("pre", { class: "mc-pre" }, message.text));
  if (message.skill_block) {
    box.append(h("div", { class: "mc-skill-block", title: "skills injected by MetaClaw" },
      h("div", { class: "mc-skill-block-title" }, "injected skill block"),
      h("pre", { class: "mc-pre" }, message.skill_block)));
  }
  for (const call of message.tool_calls || []) box.append(toolCallView(call));
  return box;
}

// JSON text indented for reading; any other text as it is.
function pretty(text) {
  if (typeof text !== "string") return JSON.stringify(text, null, 2);
  try {
    const value = JSON.parse(text);
    return value !== null && typeof value === "object" ? JSON.stringify(value, null, 2) : text;
  } catch (error) {
    return text;
  }
}

function toolCallView(call) {
  return h("details", { class: "mc-tool-call" },
    h("summary", {}, h("code", {}, `${call.name}(${(call.arguments || "").slice(0, 80)})`),
      call.result !== undefined && call.result !== null ? h("span", { class: "mc-muted" }, " → result") : null),
    h("pre", { class: "mc-pre" }, pretty(call.arguments || "")),
    call.result !== undefined && call.result !== null ? h("pre", { class: "mc-pre mc-result" }, pretty(call.result)) : null);
}

// Who scored the turn: the judge when it left votes, else whatever recorded the reward (a
// pipeline's check, say), so that a badge never says "judge" beside "not judged".
function scorer(d) {
  if ((d.judge_votes || []).length) return "judge";
  if (d.reward === null || d.reward === undefined) return "judge";
  return d.judge_model || "score";
}

function labelForm(model, detail) {
  const note = h("input", { class: "mc-input", placeholder: "note", "aria-label": "label note" });
  const corrected = h("textarea", { class: "mc-input mc-corrected", rows: 2, placeholder: "corrected answer (optional)", "aria-label": "corrected answer" });
  const submit = (verdict) => send(model, "label_request", {
    turn_id: detail.id, verdict, note: note.value, corrected: corrected.value, nonce: ++nonce,
  });
  return h("div", { class: "mc-label-form" },
    h("button", { class: "mc-button mc-pass", onclick: () => submit("pass") }, "✓ pass"),
    h("button", { class: "mc-button mc-fail", onclick: () => submit("fail") }, "✗ fail"),
    note, corrected);
}

function detailView(model, d) {
  if (!d || d.id === undefined) return h("div", { class: "mc-muted" }, "Select a turn.");
  const pane = h("div", { class: "mc-trace-detail" });
  pane.append(h("div", { class: "mc-summary" },
    h("b", {}, `Turn #${d.id}`), ` (index ${d.turn_index}, ${d.turn_type})`,
    h("span", { class: "mc-badge" }, `skill generation ${d.skill_generation}`),
    h("span", { class: "mc-badge" }, `policy v${d.policy_version}`),
    verdictBadge(scorer(d), d.judge), verdictBadge("human", d.human_label),
    d.status !== "ok" ? h("span", { class: "mc-badge mc-bad" }, `status ${d.status}`) : null));
  if (d.error) pane.append(h("div", { class: "mc-error" }, d.error));

  const retrieval = d.retrieval || {};
  const scores = retrieval.scores || [];
  pane.append(h("div", { class: "mc-subtitle" }, "Retrieval"),
    h("div", { class: "mc-retrieval" },
      h("div", {}, "query: ", retrieval.query ? h("code", {}, retrieval.query) : h("span", { class: "mc-muted" }, "not recorded")),
      scores.length
        ? h("table", { class: "mc-scores" }, scores.map((s) => h("tr", {},
            h("td", {}, s.name), h("td", {}, s.score === null || s.score === undefined ? "—" : Number(s.score).toFixed(3)),
            h("td", { class: "mc-muted" }, [s.injected === false ? `not injected: below ${Number(s.below).toFixed(3)}` : "", s.use_when ? `use when: ${s.use_when}` : "", s.example_asks ? `${s.example_asks} example asks` : "", s.anticipated_asks ? `${s.anticipated_asks} anticipated asks` : "", s.near_miss_asks ? `${s.near_miss_asks} near-miss asks` : "", s.held_back ? `${s.injected === false ? "held back" : "lowered"} by its near-miss ask "${s.held_back.ask}"` : ""].filter(Boolean).join(" · ")))))
        : h("div", { class: "mc-muted" }, "no skill injected")));

  pane.append(h("div", { class: "mc-subtitle" }, "Request as the upstream saw it"));
  for (const message of d.messages || []) pane.append(messageView(message));

  pane.append(h("div", { class: "mc-subtitle" }, "Reply"),
    h("div", { class: "mc-msg mc-msg-assistant mc-reply" }, h("pre", { class: "mc-pre" }, d.response || "")));
  for (const call of d.tool_calls || []) pane.append(toolCallView(call));

  pane.append(h("div", { class: "mc-subtitle" }, "Judge"));
  const votes = d.judge_votes || [];
  if (!votes.length && (d.reward === null || d.reward === undefined)) pane.append(h("div", { class: "mc-muted" }, "not judged"));
  else if (!votes.length) {
    pane.append(h("div", { class: "mc-vote" }, h("span", { class: "mc-badge" }, formatScore(d.reward)),
      ` no judge votes: the reward was recorded by ${d.judge_model || "another scorer"}`,
      d.judge_rationale ? ` — ${d.judge_rationale}` : ""));
  }
  for (const vote of votes) {
    pane.append(h("div", { class: "mc-vote" }, h("span", { class: "mc-badge" }, formatScore(vote.score)), " ",
      vote.rationale || vote.error || ""));
  }

  pane.append(h("div", { class: "mc-subtitle" }, "Human labels"));
  for (const label of d.labels || []) {
    pane.append(h("div", { class: "mc-label" }, verdictBadge("", label.verdict),
      ` ${label.author}`, label.note ? ` — ${label.note}` : "",
      label.corrected ? h("div", { class: "mc-muted mc-indent" }, `corrected: ${label.corrected}`) : null));
  }
  pane.append(labelForm(model, d));

  const written = d.written_for || [];
  if (written.length || d.failed) {
    pane.append(h("div", { class: "mc-subtitle" }, "Written for this turn"));
    if (!written.length) pane.append(h("div", { class: "mc-muted" }, "no skill generation cites this turn yet"));
    for (const w of written) {
      const head = w.generation === null
        ? `proposal #${w.proposal_id} ${w.kind}`
        : `generation ${w.generation} (${w.kind}): ${w.op} ${w.skill_name}`;
      pane.append(h("details", { class: "mc-written" }, h("summary", {}, head, w.reason ? h("span", { class: "mc-muted" }, ` — ${w.reason}`) : null),
        w.skill_markdown ? h("pre", { class: "mc-pre" }, w.skill_markdown) : null));
    }
    const after = d.after || [];
    if (after.length) {
      pane.append(h("button", { class: "mc-button mc-jump", onclick: () => send(model, "step_request", { jump: "after", nonce: ++nonce }) },
        `→ first turn after it (#${after[0].id}, ${after.length} turns)`));
    }
  }
  return pane;
}

function render({ model, el }) {
  el.classList.add("metaclaw-w", "metaclaw-trace");

  const draw = () => {
    const rows = model.get("rows") || [];
    const selected = model.get("selected");
    const sessions = model.get("sessions") || [];
    const sessionSelect = h("select", { class: "mc-select", "aria-label": "session", onchange: (e) => send(model, "session_id", e.target.value) });
    for (const s of sessions) {
      const option = h("option", { value: s.id }, `${s.id} (${s.turns} turns, ${s.failures} failed)`);
      if (s.id === model.get("session_id")) option.selected = true;
      sessionSelect.append(option);
    }
    const failuresOnly = h("input", { type: "checkbox", "aria-label": "failures only", checked: model.get("failures_only"),
      onchange: (e) => send(model, "failures_only", e.target.checked) });
    const step = (delta, failures) => () => send(model, "step_request", { delta, failures, nonce: ++nonce });
    const toolbar = h("div", { class: "mc-toolbar" },
      h("span", { class: "mc-title" }, "Trace"),
      h("label", {}, "session ", sessionSelect),
      h("label", {}, failuresOnly, " failures only"),
      h("button", { class: "mc-button", "aria-label": "previous failure", onclick: step(-1, true) }, "⇤ fail"),
      h("button", { class: "mc-button", "aria-label": "previous turn", onclick: step(-1, false) }, "◀"),
      h("span", { class: "mc-position" }, `${model.get("matched") ? model.get("position") + 1 : 0} / ${model.get("matched")}`),
      h("button", { class: "mc-button", "aria-label": "next turn", onclick: step(1, false) }, "▶"),
      h("button", { class: "mc-button", "aria-label": "next failure", onclick: step(1, true) }, "fail ⇥"),
      h("span", { class: "mc-muted" }, `${model.get("total")} turns · ${model.get("failure_count")} failed`),
      // turns recorded (or labelled) since the widget was shown, by this kernel or another process
      h("button", { class: "mc-button", "aria-label": "refresh", onclick: () => send(model, "refresh_requests", (model.get("refresh_requests") || 0) + 1) }, "refresh"));

    const list = h("div", { class: "mc-trace-list" });
    for (const row of rows) {
      const cls = `mc-trace-row${row.failed ? " mc-failed" : ""}${row.id === selected ? " mc-selected" : ""}`;
      list.append(h("div", { class: cls, "data-turn": row.id, onclick: () => send(model, "selected", row.id) },
        h("span", { class: "mc-turn-id" }, `#${row.id}`), " ",
        h("span", { class: "mc-badge" }, `g${row.skill_generation}`), " ",
        h("span", { class: row.failed ? "mc-bad" : "mc-good" }, row.human_label ? `human ${row.human_label}` : formatScore(row.reward)), " ",
        row.tool_calls ? h("span", { class: "mc-muted" }, `${row.tool_calls} calls `) : null,
        row.turn_type && row.turn_type !== "main" ? h("span", { class: "mc-muted" }, `${row.turn_type} `) : null,
        h("span", { class: "mc-task" }, (row.last_text || "").slice(0, 70))));
    }
    const offset = model.get("offset");
    const size = model.get("page_size");
    const matched = model.get("matched");
    const pager = h("div", { class: "mc-pager" },
      h("button", { class: "mc-button", disabled: offset <= 0, onclick: () => send(model, "offset", Math.max(0, offset - size)) }, "‹ page"),
      h("span", { class: "mc-muted" }, ` ${matched ? offset + 1 : 0}–${Math.min(offset + size, matched)} `),
      h("button", { class: "mc-button", disabled: offset + size >= matched, onclick: () => send(model, "offset", offset + size) }, "page ›"));

    const parts = [toolbar];
    if (model.get("error")) parts.push(h("div", { class: "mc-error" }, model.get("error")));
    if (model.get("message")) parts.push(h("div", { class: "mc-message mc-muted" }, model.get("message")));
    parts.push(h("div", { class: "mc-trace-body" }, h("div", { class: "mc-trace-side" }, list, pager), detailView(model, model.get("detail"))));
    el.replaceChildren(...parts);
  };

  const events = ["rows", "selected", "detail", "sessions", "session_id", "failures_only", "offset", "matched", "position", "total", "error", "message"].map((k) => `change:${k}`);
  for (const name of events) model.on(name, draw);
  draw();
  return () => {
    for (const name of events) model.off(name, draw);
  };
}

export default { render };
