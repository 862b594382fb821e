// BufferWidget front-end: the support and query sets by skill generation, filterable, with a
// drill-down into one turn's messages. Rows, counts and the selected turn's detail come from
// the synced traitlets; filters and the selection go back with model.set + save_changes.

// h(): widgets/common.js, put before this module (metaclaw/notebook/widgets/base.py esm)

function formatReward(value) {
  if (value === null || value === undefined) return "—";
  return (value > 0 ? "+" : "") + Number(value).toFixed(value % 1 === 0 ? 0 : 2);
}

function rewardClass(value) {
  if (value === null || value === undefined) return "mc-reward";
  return value > 0 ? "mc-reward mc-good" : value < 0 ? "mc-reward mc-bad" : "mc-reward";
}

function formatTime(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const d = new Date(seconds * 1000);
  return d.toLocaleString();
}

function contentText(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content
      .map((part) => (typeof part === "string" ? part : part && part.type === "text" ? part.text : `[${(part && part.type) || "part"}]`))
      .join("\n");
  }
  return JSON.stringify(content, null, 2);
}

function choiceSelect(model, key, choices, label) {
  const current = model.get(key);
  const select = h("select", {
    class: "mc-select",
    "aria-label": label,
    onchange: (event) => {
      const raw = event.target.value;
      model.set(key, key === "generation_filter" ? (raw === "" ? null : Number(raw)) : raw);
      model.save_changes();
    },
  });
  for (const [value, text] of choices) {
    const option = h("option", { value: value === null ? "" : value }, text);
    if (value === current) option.selected = true;
    select.append(option);
  }
  return select;
}

// A tool call with its JSON arguments parsed, so that they show indented, not as one escaped line.
function readableCall(call) {
  const fn = (call && call.function) || {};
  if (typeof fn.arguments !== "string") return call;
  try {
    return { ...call, function: { ...fn, arguments: JSON.parse(fn.arguments) } };
  } catch (error) {
    return call;
  }
}

function messageView(message) {
  const role = message.role || "message";
  const box = h("div", { class: `mc-message mc-role-${role}` },
    h("div", { class: "mc-role" }, role + (message.name ? ` (${message.name})` : "")));
  const text = contentText(message.content);
  if (text) box.append(h("pre", { class: "mc-content" }, text));
  if (message.tool_calls && message.tool_calls.length) {
    box.append(h("pre", { class: "mc-content mc-tool" }, JSON.stringify(message.tool_calls.map(readableCall), null, 2)));
  }
  if (message.tool_call_id) box.append(h("div", { class: "mc-muted" }, `tool_call_id: ${message.tool_call_id}`));
  return box;
}

function detailView(model, detail) {
  const close = h("button", {
    class: "mc-button",
    onclick: () => {
      model.set("selected", null);
      model.save_changes();
    },
  }, "close");
  const panel = h("div", { class: "mc-detail" },
    h("div", { class: "mc-toolbar" },
      h("span", { class: "mc-title" }, `Turn #${detail.id}`),
      h("span", { class: "mc-muted" },
        `session ${detail.session_id} · generation ${detail.skill_generation} · ` +
        `${detail.buffer_set || "no set"} / ${detail.buffer_state || "—"} · reward `),
      h("span", { class: rewardClass(detail.reward) }, formatReward(detail.reward)),
      close));
  if (detail.judge_rationale) {
    panel.append(h("div", { class: "mc-subtitle" }, "Judge"), h("pre", { class: "mc-content" }, detail.judge_rationale));
  }
  panel.append(h("div", { class: "mc-subtitle" }, "Request messages"));
  for (const message of detail.request_messages || []) panel.append(messageView(message));
  panel.append(h("div", { class: "mc-subtitle" }, "Response"));
  panel.append(messageView({ role: "assistant", content: detail.response, tool_calls: detail.tool_calls }));
  if (detail.error) panel.append(h("div", { class: "mc-error" }, detail.error));
  return panel;
}

function render({ model, el }) {
  el.classList.add("metaclaw-w", "metaclaw-buffers");
  let textTimer = null;

  // The toolbar is built once so the text box keeps its focus while rows update.
  const text = h("input", {
    class: "mc-input",
    type: "search",
    placeholder: "filter task / session…",
    "aria-label": "text filter",
    oninput: (event) => {
      clearTimeout(textTimer);
      const value = event.target.value;
      textTimer = setTimeout(() => {
        model.set("text_filter", value);
        model.save_changes();
      }, 300);
    },
  });
  text.value = model.get("text_filter") || "";
  const refresh = h("button", {
    class: "mc-button",
    onclick: () => {
      model.set("refresh_requests", (model.get("refresh_requests") || 0) + 1);
      model.save_changes();
    },
  }, "refresh");
  const setSlot = h("label", {});
  const stateSlot = h("label", {});
  const generationSlot = h("label", {});
  const toolbar = h("div", { class: "mc-toolbar" },
    h("span", { class: "mc-title" }, "Buffers"), setSlot, stateSlot, generationSlot, text, refresh);
  const content = h("div", {});
  el.replaceChildren(toolbar, content);

  const drawFilters = () => {
    const generations = model.get("generations") || [];
    setSlot.replaceChildren("set ", choiceSelect(model, "set_filter",
      [["all", "all"], ["support", "support"], ["query", "query"], ["none", "no set"]], "set"));
    stateSlot.replaceChildren("state ", choiceSelect(model, "state_filter",
      [["all", "all"], ["live", "live"], ["consumed", "consumed"], ["purged", "purged"]], "state"));
    generationSlot.replaceChildren("generation ", choiceSelect(model, "generation_filter",
      [[null, "all"], ...generations.map((g) => [g, String(g)])], "generation"));
    if (document.activeElement !== text) text.value = model.get("text_filter") || "";
  };

  const draw = () => {
    const rows = model.get("rows") || [];
    const counts = model.get("counts") || {};
    const detail = model.get("detail") || {};
    const selected = model.get("selected");
    const error = model.get("error") || "";

    const summary = h("div", { class: "mc-summary" });
    for (const set of ["support", "query"]) {
      const c = counts[set] || {};
      summary.append(h("span", { class: "mc-count" },
        h("b", {}, set), `: ${c.live || 0} live · ${c.consumed || 0} consumed · ${c.purged || 0} purged`));
    }
    summary.append(h("span", { class: "mc-muted" },
      `showing ${rows.length} of ${model.get("matched") || 0} matching (${model.get("total") || 0} turns)`));
    // a snapshot: later turns and generations show after "refresh"
    if (model.get("taken_at")) summary.append(h("span", { class: "mc-muted mc-taken" }, `snapshot of ${formatTime(model.get("taken_at"))}`));

    const table = h("table", { class: "mc-table" },
      h("thead", {}, h("tr", {}, ["turn", "session", "set", "state", "gen", "reward", "time", "task"].map((c) => h("th", {}, c)))));
    const tbody = h("tbody");
    for (const row of rows) {
      tbody.append(h("tr", {
        class: row.id === selected ? "mc-row mc-selected" : "mc-row",
        title: "show this turn's messages",
        onclick: () => {
          model.set("selected", row.id);
          model.save_changes();
        },
      },
        h("td", {}, `#${row.id}`),
        h("td", { class: "mc-muted" }, row.turn_type && row.turn_type !== "main"
          ? `${row.session_id} · ${row.turn_type}` : row.session_id),
        h("td", {}, row.set ? h("span", { class: `mc-badge mc-set-${row.set}` }, row.set) : "—"),
        h("td", {}, row.state ? h("span", { class: `mc-badge mc-state-${row.state}` }, row.state) : "—"),
        h("td", {}, row.skill_generation),
        h("td", { class: rewardClass(row.reward) }, formatReward(row.reward)),
        h("td", { class: "mc-muted" }, formatTime(row.created_at)),
        h("td", { class: "mc-task" }, row.task || "")));
    }
    table.append(tbody);

    const parts = [summary];
    if (error) parts.push(h("div", { class: "mc-error" }, error));
    parts.push(rows.length ? h("div", { class: "mc-scroll" }, table) : h("div", { class: "mc-muted" }, "No turns match these filters."));
    if (selected !== null && selected !== undefined && detail && detail.id === selected) parts.push(detailView(model, detail));
    content.replaceChildren(...parts);
  };

  const filterEvents = ["change:generations", "change:set_filter", "change:state_filter", "change:generation_filter", "change:text_filter"];
  const events = ["change:rows", "change:counts", "change:detail", "change:selected", "change:error", "change:matched", "change:total", "change:taken_at"];
  for (const name of filterEvents) model.on(name, drawFilters);
  for (const name of events) model.on(name, draw);
  drawFilters();
  draw();
  return () => {
    clearTimeout(textTimer);
    for (const name of filterEvents) model.off(name, drawFilters);
    for (const name of events) model.off(name, draw);
  };
}

export default { render };
