// SchedulerView front-end: the scheduler's current state, each signal's reading, and a
// timeline of its states (windows) and transitions. Data comes from the synced traitlets;
// the refresh button asks Python to read the status again.

// h(): widgets/common.js, put before this module (metaclaw/notebook/widgets/base.py esm)

function formatTime(seconds) {
  if (seconds === null || seconds === undefined) return "now";
  return new Date(seconds * 1000).toLocaleString();
}

function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "";
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function formatValue(value) {
  if (value === null || value === undefined) return "—";
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(2);
  if (typeof value === "string") return value;
  if (Array.isArray(value)) return value.map(formatValue).join(", ");
  return Object.entries(value).map(([k, v]) => `${k}: ${formatValue(v)}`).join(" · ");
}

function stateClass(state) {
  return "mc-state-" + String(state || "unknown").replace(/[^a-z0-9_-]/gi, "-").toLowerCase();
}

function timeline(segments, now) {
  if (!segments.length) return h("div", { class: "mc-muted" }, "No transitions recorded yet.");
  const start = segments[0].start;
  const end = Math.max(now || 0, ...segments.map((s) => s.end ?? s.start));
  const span = Math.max(end - start, 1e-9);
  const bar = h("div", { class: "mc-timeline", role: "img", "aria-label": "scheduler state timeline" });
  for (const segment of segments) {
    const stop = segment.end ?? end;
    const width = Math.max(((stop - segment.start) / span) * 100, 0.5);
    bar.append(h("div", {
      class: `mc-segment ${stateClass(segment.state)}`,
      style: `width:${width}%`,
      title: `${segment.state}: ${formatTime(segment.start)} → ${segment.end ? formatTime(segment.end) : "now"} (${formatDuration(stop - segment.start)})`,
    }));
  }
  const legend = h("div", { class: "mc-legend" });
  for (const state of [...new Set(segments.map((s) => s.state))]) {
    legend.append(h("span", { class: "mc-legend-item" }, h("span", { class: `mc-swatch ${stateClass(state)}` }), state));
  }
  return h("div", {}, bar,
    h("div", { class: "mc-axis" }, h("span", {}, formatTime(start)), h("span", {}, formatTime(end))),
    legend);
}

function render({ model, el }) {
  el.classList.add("metaclaw-w", "metaclaw-scheduler");

  const draw = () => {
    const state = model.get("state") || "unknown";
    const signals = model.get("signals") || [];
    const transitions = model.get("transitions") || [];
    const segments = model.get("segments") || [];
    const error = model.get("error") || "";

    const refresh = h("button", {
      class: "mc-button",
      onclick: () => {
        model.set("refresh_requests", (model.get("refresh_requests") || 0) + 1);
        model.save_changes();
      },
    }, "refresh");

    const header = h("div", { class: "mc-toolbar" },
      h("span", { class: "mc-title" }, "Scheduler"),
      h("span", { class: `mc-badge mc-big ${stateClass(state)}` }, state),
      h("span", { class: "mc-muted" }, `as of ${formatTime(model.get("now"))}`),
      refresh);

    const signalTable = h("table", { class: "mc-table" },
      h("thead", {}, h("tr", {}, h("th", {}, "signal"), h("th", {}, "reads"), h("th", {}, "detail"))));
    const body = h("tbody");
    for (const signal of signals) {
      const reading = signal.reading === "unavailable" ? "not available" : formatValue(signal.reading);
      const cls = reading === "idle" ? "mc-good" : reading === "active" ? "mc-bad" : "mc-muted";
      body.append(h("tr", {},
        h("td", {}, h("b", {}, signal.name)),
        h("td", { class: cls }, reading),
        // plain words; the technical reason (which libraries were tried) on hover
        h("td", { class: "mc-muted", title: signal.raw || null }, formatValue(signal.detail))));
    }
    if (!signals.length) body.append(h("tr", {}, h("td", { colspan: 3, class: "mc-muted" }, "no signals configured")));
    signalTable.append(body);

    const summary = model.get("summary") || {};
    const summaryLine = Object.keys(summary).length
      ? h("div", { class: "mc-summary mc-muted" },
        Object.entries(summary).map(([k, v]) => h("span", {}, `${k}: ${formatValue(v)}`)))
      : null;

    const transitionTable = h("table", { class: "mc-table" },
      h("thead", {}, h("tr", {}, ["time", "from", "to", "reason"].map((c) => h("th", {}, c)))));
    const tbody = h("tbody");
    for (const t of [...transitions].reverse()) {
      tbody.append(h("tr", {},
        h("td", { class: "mc-muted" }, formatTime(t.at)),
        h("td", {}, h("span", { class: `mc-badge ${stateClass(t.from_state)}` }, t.from_state)),
        h("td", {}, h("span", { class: `mc-badge ${stateClass(t.to_state)}` }, t.to_state)),
        h("td", {}, t.reason || "")));
    }
    transitionTable.append(tbody);

    const parts = [header];
    if (summaryLine) parts.push(summaryLine);
    if (error) parts.push(h("div", { class: "mc-error" }, error));
    parts.push(h("div", { class: "mc-subtitle" }, "Signals"), signalTable,
      h("div", { class: "mc-subtitle" }, "Timeline"), timeline(segments, model.get("now")),
      h("div", { class: "mc-subtitle" }, `Transitions (${transitions.length})`),
      transitions.length ? h("div", { class: "mc-scroll" }, transitionTable) : h("div", { class: "mc-muted" }, "none yet"));
    el.replaceChildren(...parts);
  };

  const events = ["change:state", "change:signals", "change:transitions", "change:segments", "change:error", "change:now", "change:summary"];
  for (const name of events) model.on(name, draw);
  draw();
  return () => {
    for (const name of events) model.off(name, draw);
  };
}

export default { render };
