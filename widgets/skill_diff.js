// SkillDiffWidget front-end: pick two skill generations and see what changed between them,
// with the evidence turns behind each change. All data comes from the synced traitlets
// (generations, old, new, mode, diff, error, follow, latest); choices go back with model.set +
// save_changes. The widget is pinned to the generations it shows unless "follow" is ticked.
// A diff with more than OPEN_CARDS changed skills shows one summary line per skill, opened on
// demand; what the reader opened stays open when the data changes.

const OPEN_CARDS = 3;

// h(): widgets/common.js, put before this module (metaclaw/notebook/widgets/base.py esm)

function formatReward(value) {
  if (value === null || value === undefined) return "unjudged";
  return (value > 0 ? "+" : "") + Number(value).toFixed(value % 1 === 0 ? 0 : 2);
}

function generationLabel(g) {
  if (g.label) return g.label;  // number · kind · the skills it changed · how many skills
  const reason = g.reason ? ` — ${g.reason.length > 40 ? g.reason.slice(0, 40) + "…" : g.reason}` : "";
  return `${g.generation} · ${g.kind}${reason}`;
}

function generationSelect(model, key, generations) {
  const current = model.get(key);
  const select = h("select", {
    class: "mc-select",
    "aria-label": key === "old" ? "old generation" : "new generation",
    onchange: (event) => {
      model.set(key, Number(event.target.value));
      model.save_changes();
    },
  });
  for (const g of generations) {
    const option = h("option", { value: g.generation }, generationLabel(g));
    if (g.generation === current) option.selected = true;
    select.append(option);
  }
  return select;
}

// Parse a unified diff into rows for display. Each row is
// {kind: "hunk"|"ctx"|"del"|"add"|"pair"|"meta", left, right, text}.
function parseUnified(text) {
  const lines = (text || "").replace(/\n$/, "").split("\n");
  const unified = [];
  let inHunk = false;
  for (const line of lines) {
    if (!inHunk && (line.startsWith("---") || line.startsWith("+++"))) {
      unified.push({ kind: "meta", text: line });
    } else if (line.startsWith("@@")) {
      inHunk = true;
      unified.push({ kind: "hunk", text: line });
    } else if (line.startsWith("-")) {
      unified.push({ kind: "del", text: line.slice(1) });
    } else if (line.startsWith("+")) {
      unified.push({ kind: "add", text: line.slice(1) });
    } else if (line.startsWith("\\")) {
      unified.push({ kind: "meta", text: line });
    } else {
      unified.push({ kind: "ctx", text: line.slice(1) });
    }
  }
  return unified;
}

function sideBySideRows(unified) {
  const rows = [];
  let dels = [];
  let adds = [];
  const flush = () => {
    const n = Math.max(dels.length, adds.length);
    for (let i = 0; i < n; i++) {
      rows.push({ kind: "pair", left: dels[i] ?? null, right: adds[i] ?? null });
    }
    dels = [];
    adds = [];
  };
  for (const row of unified) {
    if (row.kind === "del") dels.push(row.text);
    else if (row.kind === "add") adds.push(row.text);
    else {
      flush();
      if (row.kind === "ctx") rows.push({ kind: "ctx", left: row.text, right: row.text });
      else if (row.kind === "hunk") rows.push({ kind: "hunk", text: row.text });
    }
  }
  flush();
  return rows;
}

function unifiedView(text) {
  const pre = h("pre", { class: "mc-diff mc-diff-unified" });
  for (const row of parseUnified(text)) {
    const sign = { add: "+", del: "-", ctx: " ", hunk: "", meta: "" }[row.kind];
    pre.append(h("div", { class: `mc-line mc-${row.kind}` }, sign + row.text));
  }
  return pre;
}

function sideBySideView(text) {
  const table = h("table", { class: "mc-diff mc-diff-sbs" });
  for (const row of sideBySideRows(parseUnified(text))) {
    if (row.kind === "hunk") {
      table.append(h("tr", { class: "mc-hunk" }, h("td", { colspan: 2 }, row.text)));
      continue;
    }
    const leftKind = row.kind === "ctx" ? "ctx" : row.left === null ? "empty" : "del";
    const rightKind = row.kind === "ctx" ? "ctx" : row.right === null ? "empty" : "add";
    table.append(h("tr", {},
      h("td", { class: `mc-line mc-${leftKind}` }, row.left ?? ""),
      h("td", { class: `mc-line mc-${rightKind}` }, row.right ?? "")));
  }
  return table;
}

function evidenceView(diff, name) {
  const events = (diff.events || []).filter((e) => e.skill_name === name);
  if (!events.length) return h("div", { class: "mc-muted" }, "No recorded events for this skill in this range.");
  const turns = diff.turns || {};
  const box = h("div", { class: "mc-evidence" });
  for (const event of events) {
    const ids = event.evidence || [];
    box.append(h("div", { class: "mc-event" },
      h("span", { class: `mc-badge mc-op-${event.op}` }, event.op),
      ` generation ${event.generation}`,
      event.reason ? h("span", { class: "mc-reason" }, ` — ${event.reason}`) : null));
    if (!ids.length) {
      box.append(h("div", { class: "mc-muted mc-indent" }, "no evidence turns recorded"));
      continue;
    }
    const list = h("ul", { class: "mc-turns" });
    for (const id of ids) {
      const turn = turns[String(id)];
      if (!turn) {
        list.append(h("li", {}, `turn #${id} (not in the store)`));
        continue;
      }
      const reward = turn.reward;
      const cls = reward === null || reward === undefined ? "mc-reward" : reward > 0 ? "mc-reward mc-good" : reward < 0 ? "mc-reward mc-bad" : "mc-reward";
      list.append(h("li", {},
        h("span", { class: "mc-turn-id" }, `#${id}`), " ",
        h("span", { class: cls }, formatReward(reward)), " ",
        h("span", { class: "mc-task" }, turn.task || "(no user message)")));
    }
    box.append(list);
  }
  return box;
}

function skillCard(diff, kind, item, mode, open, opened) {
  const name = item.name;
  const title = h("summary", {},
    h("span", { class: `mc-badge mc-op-${kind}` }, { add: "added", edit: "edited", remove: "removed" }[kind]),
    " ", h("b", {}, name),
    item.description ? h("span", { class: "mc-muted" }, ` — ${item.description}`) : null);
  const card = h("details", { class: `mc-card mc-card-${kind}`, open, "data-skill": name }, title);
  card.addEventListener("toggle", () => {
    if (card.open) opened.add(name);
    else opened.delete(name);
  });
  // what retrieval matches this skill on, besides its text (each count's tooltip lists the asks)
  const keys = [item.use_when ? `use when: ${item.use_when}` : null];
  for (const [asks, label] of [[item.example_asks || [], "example ask"],
    [item.anticipated_asks || [], "anticipated ask"], [item.near_miss_asks || [], "near-miss ask"]]) {
    if (asks.length) keys.push(h("span", { title: asks.join("\n") }, `${asks.length} ${label}${asks.length === 1 ? "" : "s"}`));
  }
  const shown = keys.filter(Boolean);
  if (shown.length) {
    card.append(h("div", { class: "mc-muted mc-keys" }, ...shown.flatMap((k, i) => (i ? [" · ", k] : [k]))));
  }
  if (kind === "edit") {
    card.append(mode === "side-by-side" ? sideBySideView(item.unified_diff) : unifiedView(item.unified_diff));
  } else {
    const pre = h("pre", { class: "mc-diff mc-diff-unified" });
    const sign = kind === "add" ? "+" : "-";
    for (const line of (item.markdown || "").replace(/\n$/, "").split("\n")) {
      pre.append(h("div", { class: `mc-line mc-${kind === "add" ? "add" : "del"}` }, sign + line));
    }
    card.append(pre);
  }
  card.append(h("div", { class: "mc-subtitle" }, "Evidence"), evidenceView(diff, name));
  return card;
}

let nonce = 0;
function act(model, request) {
  model.set("proposal_action", { ...request, nonce: ++nonce });
  model.save_changes();
}

function score(value) {
  if (value === null || value === undefined) return "—";
  return (value > 0 ? "+" : "") + Number(value).toFixed(0);
}

// The gate's evidence: one row per replayed turn, its score without and with the candidate.
function casesView(p) {
  const cases = p.cases || [];
  const box = h("div", { class: "mc-evidence" });
  if ((p.safety || []).length) {
    box.append(h("div", { class: "mc-error" }, "Safety findings: ",
      p.safety.map((f) => `${f.skill}: ${f.category} (“${f.excerpt}”)`).join("; ")));
  }
  if (!cases.length) {
    box.append(h("div", { class: "mc-muted" }, "no replay evidence"));
    return box;
  }
  const table = h("table", { class: "mc-cases" },
    h("tr", {}, ["turn", "case", "before", "after", "outcome", "reply before", "reply after"].map((t) => h("th", {}, t))));
  for (const c of cases) {
    table.append(h("tr", { class: "mc-case" },
      h("td", {}, `#${c.turn_id}`), h("td", {}, c.kind),
      h("td", {}, score(c.before)), h("td", {}, score(c.after)),
      h("td", { class: `mc-case-${(c.outcome || "").replace(/ /g, "-")}` }, c.outcome || ""),
      h("td", { class: "mc-muted" }, (c.before_reply || c.error || "").slice(0, 120)),
      h("td", {}, (c.after_reply || "").slice(0, 120))));
  }
  box.append(table);
  return box;
}

function proposalCard(model, p, mode) {
  const held = p.status === "held";
  const by = p.decided_by ? ` by ${p.decided_by}` : "";
  const gen = p.generation !== null && p.generation !== undefined ? ` → generation ${p.generation}` : "";
  const card = h("details", { class: `mc-card mc-proposal mc-proposal-${p.status}`, open: held, "data-proposal": p.id },
    h("summary", {}, h("span", { class: "mc-badge" }, `${p.origin} · ${p.status}${by}${gen}`), " ",
      h("b", {}, `Proposal #${p.id}`), h("span", { class: "mc-muted" }, ` — ${p.reason}`), " ",
      h("span", { class: "mc-badge mc-judge-calls" }, `${p.judge_calls} judge votes`)));
  const side = h("div", { class: "mc-proposal-body" });
  const edits = {};
  for (const d of p.diffs || []) {
    const column = h("div", { class: "mc-proposal-op" },
      h("div", {}, h("span", { class: `mc-badge mc-op-${d.op}` }, d.op), " ", h("b", {}, d.name),
        d.reason ? h("span", { class: "mc-muted" }, ` — ${d.reason}`) : null));
    column.append(mode === "side-by-side" ? sideBySideView(d.unified_diff) : unifiedView(d.unified_diff));
    if (held && d.op !== "remove") {
      const body = (d.markdown || "").replace(/^---[\s\S]*?---\n+/, "");
      const area = h("textarea", { class: "mc-input mc-edit-body", rows: 5, "aria-label": `edit ${d.name}` });
      area.value = body;
      edits[d.name] = area;
      column.append(h("details", { class: "mc-edit" }, h("summary", {}, "edit the text"), area,
        h("button", { class: "mc-button mc-save-edit", onclick: () => act(model, { action: "edit", id: p.id, name: d.name, body: area.value }) }, "save edit")));
    }
    side.append(column);
  }
  card.append(h("div", { class: "mc-subtitle" }, "Diff"), side,
    h("div", { class: "mc-subtitle" }, `Evidence (gate: ${p.decision || "none"})`), casesView(p));
  if (held) {
    const note = h("input", { class: "mc-input", placeholder: "note (why)", "aria-label": `note for proposal ${p.id}` });
    card.append(h("div", { class: "mc-toolbar" },
      h("button", { class: "mc-button mc-promote", onclick: () => act(model, { action: "promote", id: p.id, note: note.value }) }, "promote"),
      h("button", { class: "mc-button mc-discard", onclick: () => act(model, { action: "discard", id: p.id, note: note.value }) }, "discard"),
      note, h("span", { class: "mc-muted" }, `as ${model.get("author")}`)));
  } else if ((p.history || []).length) {
    card.append(h("div", { class: "mc-muted" }, (p.history || []).map((e) => `${e.action} by ${e.by}`).join(" · ")));
  }
  return card;
}

function pinLine(model, diff) {
  const latest = model.get("latest");
  if (model.get("follow")) return "following the library: “to” moves to each new generation";
  const old = diff.old ?? model.get("old");
  const now = diff.new ?? model.get("new");
  let line = `pinned to generation ${old} → ${now}`;
  if (latest > Math.max(old, now)) line += `; the library has changed since (now generation ${latest}): tick “follow” or press refresh to see it`;
  return line;
}

function render({ model, el }) {
  el.classList.add("metaclaw-w", "metaclaw-skill-diff");
  // the cards the reader opened (or closed), by skill name, kept across redraws of one diff
  let opened = new Set();
  let closed = new Set();
  let shownPair = "";

  const draw = () => {
    const generations = model.get("generations") || [];
    const diff = model.get("diff") || {};
    const mode = model.get("mode") || "unified";
    const error = model.get("error") || "";

    const modeSelect = h("select", {
      class: "mc-select",
      "aria-label": "diff mode",
      onchange: (event) => {
        model.set("mode", event.target.value);
        model.save_changes();
      },
    });
    for (const value of ["unified", "side-by-side"]) {
      const option = h("option", { value }, value);
      if (value === mode) option.selected = true;
      modeSelect.append(option);
    }

    const header = h("div", { class: "mc-toolbar" },
      h("span", { class: "mc-title" }, "Skill diff"),
      h("label", {}, "from ", generationSelect(model, "old", generations)),
      h("label", {}, "to ", generationSelect(model, "new", generations)),
      h("label", {}, "view ", modeSelect),
      h("label", { title: "move “to” to each new generation as it is written" },
        h("input", {
          type: "checkbox", class: "mc-follow", "aria-label": "follow new generations", checked: Boolean(model.get("follow")),
          onchange: (event) => {
            model.set("follow", event.target.checked);
            model.save_changes();
          },
        }), " follow"),
      // generations and proposals changed since the widget was shown (e.g. by another process)
      h("button", {
        class: "mc-button",
        onclick: () => {
          model.set("refresh_requests", (model.get("refresh_requests") || 0) + 1);
          model.save_changes();
        },
      }, "refresh"));

    const body = h("div", { class: "mc-body" });
    if (error) body.append(h("div", { class: "mc-error" }, error));
    if (!generations.length) {
      if (!error) body.append(h("div", { class: "mc-muted" }, "No skill generations recorded yet."));
    } else if (Object.keys(diff).length) {  // what it read last stays shown beside an error
      const added = diff.added || [];
      const edited = diff.edited || [];
      const removed = diff.removed || [];
      body.append(h("div", { class: "mc-summary" },
        h("span", { class: "mc-good" }, `+${added.length} added`), " · ",
        h("span", {}, `~${edited.length} edited`), " · ",
        h("span", { class: "mc-bad" }, `−${removed.length} removed`),
        ` (generation ${diff.old ?? model.get("old")} → ${diff.new ?? model.get("new")})`));
      body.append(h("div", { class: `mc-muted mc-pin${model.get("follow") ? " mc-following" : ""}` }, pinLine(model, diff)));
      if (!added.length && !edited.length && !removed.length) {
        body.append(h("div", { class: "mc-muted" }, diff.old === diff.new
          ? `Generation ${diff.new}: pick another generation in “from” or “to” to see a change.`
          : "No changes between these generations."));
      }
      const pair = `${diff.old}→${diff.new}`;
      if (pair !== shownPair) {  // another pair of generations: the default open state again
        shownPair = pair;
        opened = new Set();
        closed = new Set();
      }
      const count = added.length + edited.length + removed.length;
      const collapsed = count > OPEN_CARDS;
      if (collapsed) {
        const setAll = (open) => () => {
          for (const card of body.querySelectorAll("details.mc-card")) card.open = open;
        };
        body.append(h("div", { class: "mc-toolbar mc-collapsed" },
          h("span", { class: "mc-muted" }, `${count} skills changed; open a card to read its text and evidence`),
          h("button", { class: "mc-button mc-open-all", onclick: setAll(true) }, "open all"),
          h("button", { class: "mc-button mc-close-all", onclick: setAll(false) }, "close all")));
      }
      const track = { add: (name) => { opened.add(name); closed.delete(name); }, delete: (name) => { opened.delete(name); closed.add(name); } };
      const isOpen = (name) => (collapsed ? opened.has(name) : !closed.has(name));
      for (const [kind, items] of [["add", added], ["edit", edited], ["remove", removed]]) {
        for (const item of items) body.append(skillCard(diff, kind, item, mode, isOpen(item.name), track));
      }
    }
    const proposals = model.get("proposals") || [];
    const section = h("div", { class: "mc-proposals" });
    if (proposals.length) {
      const held = proposals.filter((p) => p.status === "held").length;
      section.append(h("div", { class: "mc-subtitle" }, `Proposals (${held} held for review)`));
      if (model.get("message")) section.append(h("div", { class: "mc-muted mc-message" }, model.get("message")));
      for (const p of proposals) section.append(proposalCard(model, p, mode));
    } else if (model.get("old") === model.get("new")) {  // a review of proposals: say there is none
      section.append(h("div", { class: "mc-muted mc-no-proposals" }, "No proposal held for review."));
    }
    el.replaceChildren(header, body, section);
  };

  const events = ["change:generations", "change:old", "change:new", "change:mode", "change:diff", "change:error", "change:proposals", "change:message", "change:follow", "change:latest"];
  for (const name of events) model.on(name, draw);
  draw();
  return () => {
    for (const name of events) model.off(name, draw);
  };
}

export default { render };
