"""Notebook views of experiments (:mod:`metaclaw.fastloop.experiments`) and of per-skill evidence
(:mod:`metaclaw.fastloop.evidence`).

    ExperimentView(store, "gen0-vs-gen1")     # a variant picker, the summary, the cases
    EvidenceView(store, library)              # evidence.skill_stats with its suggestions
    show_experiment(None, store=store)        # what ``%metaclaw experiment [NAME]`` shows

Both are `anywidget <https://anywidget.dev>`_ classes like the other widgets of
:mod:`metaclaw.notebook.widgets`: synced traitlets and a front-end module
(``widgets/experiment.js`` + ``widgets/experiment.css``, shipped as ``metaclaw/_widgets``), all
drawing in the front-end, a static HTML form for nbconvert and GitHub, and every choice
(variant, page, selected case) drivable from plain Python.

**ExperimentView** shows one stored experiment: the variants (``variants``; the first is the
baseline every other one is compared with), the per-variant summary (``summary``: mean reward,
pass rate and, against the first variant, the paired mean difference with its bootstrap 95%
interval and McNemar's exact p, as :meth:`metaclaw.fastloop.experiments.Experiment.summary` computes
them), and the cases (``rows``: one page of ``page_size`` cases, each with every variant's
verdict and score and the picked variant's difference from the first). ``variant`` picks the
variant the table's difference column and sort compare with the first; ``sort`` orders the cases
by turn id or by that difference. Setting ``selected`` to a case's turn id fills ``detail``:
the case's task and each variant's reply, judge votes, skills and error. :meth:`open_trace`
(or the front-end's *open in trace* button) opens that turn in the trace view
(:class:`metaclaw.notebook.widgets.TraceWidget`, held in ``trace`` and shown under the table).

The view is **pinned**: it shows the results as they were when it was made (``taken_at``); a
run going on elsewhere changes nothing until :meth:`refresh` (or the *refresh* button). With
``follow=True`` (a checkbox in the front-end) it re-reads the experiment every ``poll``
seconds while new results arrive. Like the other widgets it keeps working after ``%metaclaw
stop`` and ``store.close()`` (it reopens the workspace file), and a failure is shown as one
line in ``error``, the rest of the view kept as it was.

**EvidenceView** shows :func:`metaclaw.fastloop.evidence.skill_stats` (``rows``, one per skill), the
suggestions with their reasons (``suggestions``) and, through :meth:`propose` (or the
front-end's button), files them as proposals held for review: nothing in the library changes
until a person promotes one (``%metaclaw proposals``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import traitlets
from ipywidgets import widget_serialization

from metaclaw.notebook.widgets.base import (WIDGETS_DIR, SourceGone, _clip_texts, _esc,
                                            _fmt_reward, _json_safe, _one_line, _reacts, _short,
                                            _WorkspaceWidget, esm, turn_previews)
from metaclaw.notebook.widgets.trace import TraceWidget

ESM = esm("experiment.js")


def _css() -> str:
    """The shared widget styles (``metaclaw.css``) and the views' own (``experiment.css``): a
    view shown alone on a page has both."""
    return "\n".join(path.read_text(encoding="utf-8") for path in (
        WIDGETS_DIR / "metaclaw.css", WIDGETS_DIR / "experiment.css"))


CSS = _css()

#: The summary columns the view sends to the front-end (see Experiment.summary).
SUMMARY_COLUMNS = ("variant", "cases", "scored", "mean_reward", "pass_rate", "paired",
                   "diff_vs_first", "diff_low", "diff_high", "mcnemar_p", "completion_tokens",
                   "median_latency_ms")


def _fmt_num(value: Any, fmt: str = "+.2f") -> str:
    return "—" if value is None else format(value, fmt)


def _fmt_p(value: Any) -> str:
    if value is None:
        return "—"
    return "< 0.001" if value < 0.001 else f"{value:.3g}"


# -- experiment ----------------------------------------------------------------------------
def _not_compared(variant: str, name: str, variants: list[str]) -> str:
    """Why ``variant`` cannot be compared in experiment ``name`` (its ``variants``, the first
    the baseline), and what can."""
    what = ("is the baseline the others are compared with" if variants and variant == variants[0]
            else f"is not compared in experiment {name!r}")
    return f"variant {variant!r} {what}; choose one of {', '.join(variants[1:])}"


class ExperimentView(_WorkspaceWidget):
    """One stored experiment (see the module's docstring).

    ``store``: the :class:`metaclaw.store.Store` the experiment is in; ``name``: the experiment
    (default: the most recent one); ``variant``: the variant compared with the first (default:
    the second); ``page_size``: cases per page; ``follow`` / ``poll``: re-read new results every
    ``poll`` seconds."""

    _esm = ESM
    _css = CSS

    view = traitlets.Unicode("experiment").tag(sync=True)
    experiments = traitlets.List(traitlets.Unicode()).tag(sync=True)
    name = traitlets.Unicode("").tag(sync=True)
    dataset = traitlets.Unicode("").tag(sync=True)
    variants = traitlets.List(traitlets.Unicode()).tag(sync=True)
    variant = traitlets.Unicode("").tag(sync=True)
    summary = traitlets.List(traitlets.Dict()).tag(sync=True)
    plan = traitlets.Unicode("").tag(sync=True)
    sort = traitlets.Enum(("turn", "difference"), default_value="turn").tag(sync=True)
    page_size = traitlets.Int(50).tag(sync=True)
    offset = traitlets.Int(0).tag(sync=True)
    total = traitlets.Int(0).tag(sync=True)
    rows = traitlets.List(traitlets.Dict()).tag(sync=True)
    selected = traitlets.Int(None, allow_none=True).tag(sync=True)
    detail = traitlets.Dict().tag(sync=True)
    trace = traitlets.Instance(TraceWidget, allow_none=True).tag(sync=True,
                                                                   **widget_serialization)
    trace_requests = traitlets.Int(0).tag(sync=True)
    follow = traitlets.Bool(False).tag(sync=True)
    taken_at = traitlets.Float(0.0).tag(sync=True)

    def __init__(self, store: Any, name: str | None = None, *, variant: str | None = None,
                 page_size: int = 50, sort: str = "turn", follow: bool = False,
                 poll: float = 2.0, **kwargs: Any):
        from metaclaw.fastloop import experiments as ex

        self._read_from(store)
        self._poll = float(poll)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cases: list[dict[str, Any]] = []  # every case: {turn_id, by variant}
        self._seen: tuple[Any, ...] = ()  # the results read last (follow re-reads on a change)
        names = [r["name"] for r in store.query("SELECT name FROM experiments ORDER BY id")]
        if name is None:
            if not names:
                raise ex.ExperimentError(
                    f"no experiment in {store.path} yet: make one with "
                    "metaclaw.fastloop.experiments.Experiment.create (or `metaclaw experiment run`)")
            name = names[-1]
        ex.Experiment.open(store, name)  # an unknown name fails here, naming the known ones
        super().__init__(experiments=names, name=name, page_size=int(page_size), sort=sort,
                         **kwargs)
        self._ready = True
        self._load(variant)
        if follow:
            self.follow = True

    # -- reading --------------------------------------------------------------------------
    @property
    def experiment(self) -> Any:
        """The :class:`metaclaw.fastloop.experiments.Experiment` shown (read through an open
        connection to its workspace)."""
        from metaclaw.fastloop import experiments as ex

        return ex.Experiment.open(self._store, self.name)

    def _load(self, variant: str | None = None) -> None:
        """Read the experiment: variants, summary, cases; keep the picked variant if it is
        still there."""
        run = self.experiment
        specs = [v.spec for v in run.variants]
        frame = run.frame()
        summary = run.summary()
        cases: dict[int, dict[str, Any]] = {}
        for r in frame.iter_rows(named=True):
            case = cases.setdefault(r["turn_id"], {"turn_id": r["turn_id"], "by": {}})
            case["by"][r["variant"]] = {"score": r["score"], "verdict": r["verdict"],
                                        "error": r["error"],
                                        "upstream_failed": r["upstream_failed"]}
        from metaclaw.fastloop import experiments as ex

        try:
            dataset_ids = ex.dataset_ids(run.store, run.dataset)
        except ex.ExperimentError:
            dataset_ids = []
        for turn_id in dataset_ids:  # cases not run yet are shown too, as not run
            cases.setdefault(turn_id, {"turn_id": turn_id, "by": {}})
        previews = turn_previews(run.store, cases)
        for turn_id, case in cases.items():
            preview = previews.get(str(turn_id), {})
            case["task"] = preview.get("task", "")
            case["session_id"] = preview.get("session_id")
        self._cases = [cases[t] for t in sorted(cases)]
        self._seen = self._signature()
        chosen = variant if variant is not None else self.variant
        if chosen not in specs[1:]:
            if variant is not None:
                raise ValueError(_not_compared(variant, self.name, specs))
            chosen = specs[1] if len(specs) > 1 else (specs[0] if specs else "")
        self._ready = False
        try:
            self.experiments = [r["name"] for r in run.store.query(
                "SELECT name FROM experiments ORDER BY id")]
            self.dataset = run.dataset
            self.variants = specs
            self.variant = chosen
            self.summary = _json_safe([{k: row[k] for k in SUMMARY_COLUMNS}
                                       for row in summary.iter_rows(named=True)])
            plan = run.plan(votes=1)
            self.plan = (f"{plan.done} of {plan.done + plan.replays} replays done"
                         + (f", {plan.replays} still to run" if plan.replays else ""))
            self.total = len(self._cases)
        finally:
            self._ready = True
        self.taken_at = time.time()
        self.error = ""
        self._page()
        if self.selected is not None:
            self._load_detail()

    def _difference(self, case: dict[str, Any]) -> float | None:
        first = case["by"].get(self.variants[0]) if self.variants else None
        mine = case["by"].get(self.variant)
        if not first or not mine or first["score"] is None or mine["score"] is None \
                or self.variant == self.variants[0]:
            return None
        return mine["score"] - first["score"]

    def case_rows(self) -> list[dict[str, Any]]:
        """Every case in the table's order: turn id, session, task, each variant's verdict and
        score (``by``), and the picked variant's ``difference`` from the first."""
        rows = [{**case, "difference": self._difference(case)} for case in self._cases]
        if self.sort == "difference":  # the biggest changes first; cases without one last
            rows.sort(key=lambda r: (r["difference"] is None,
                                     -abs(r["difference"] or 0), r["turn_id"]))
        return rows

    @property
    def frame(self):
        """The experiment's results, one row per case and variant (polars)."""
        return self.experiment.frame()

    def _page(self) -> None:
        rows = self.case_rows()
        start = max(0, min(self.offset, max(len(rows) - 1, 0)))
        if start != self.offset:
            self._ready = False
            self.offset = start
            self._ready = True
        self.rows = _json_safe(rows[start:start + max(1, self.page_size)])

    def _load_detail(self) -> None:
        if self.selected is None:
            self.detail = {}
            return
        turn_id = int(self.selected)
        store = self._store
        results = store.query(
            "SELECT variant, score, verdict, votes, reply, tool_calls, skills, error, "
            "upstream_failed, latency_ms, completion_tokens, label_similarity "
            "FROM experiment_results r JOIN experiments e ON e.id = r.experiment_id "
            "WHERE e.name = ? AND r.turn_id = ?", (self.name, turn_id))
        if not results and turn_id not in {c["turn_id"] for c in self._cases}:
            raise LookupError(f"turn #{turn_id} is not a case of experiment {self.name!r}; "
                              "pick a case from the table")
        from metaclaw import jsonlib

        by = {r["variant"]: r for r in results}
        variants = []
        for spec in self.variants:
            r = by.get(spec)
            if r is None:
                variants.append({"variant": spec, "run": False})
                continue
            votes = r["votes"]
            variants.append({
                "variant": spec, "run": True, "score": r["score"], "verdict": r["verdict"],
                "votes": jsonlib.loads(votes) if isinstance(votes, str) else votes,
                "reply": r["reply"] or "",
                "tool_calls": (jsonlib.loads(r["tool_calls"]) if isinstance(r["tool_calls"], str)
                               else r["tool_calls"]),
                "skills": jsonlib.loads(r["skills"]) if isinstance(r["skills"], str)
                else r["skills"],
                "error": r["error"], "upstream_failed": bool(r["upstream_failed"]),
                "latency_ms": r["latency_ms"], "completion_tokens": r["completion_tokens"],
                "label_similarity": r["label_similarity"]})
        turn = store.turn(turn_id) or {}
        from metaclaw.buffers import message_text

        asks = [m for m in turn.get("request_messages") or []
                if isinstance(m, dict) and m.get("role") == "user"]
        self.detail = _clip_texts(_json_safe({
            "turn_id": turn_id, "session_id": turn.get("session_id"),
            "task": message_text(asks[-1].get("content")) if asks else "",
            "recorded_reward": turn.get("reward"),
            "human_label": turn.get("human_label"), "recorded_response": turn.get("response"),
            "variants": variants}))

    # -- actions --------------------------------------------------------------------------
    def refresh(self) -> "ExperimentView":
        """Re-read the experiment (results a run stored since); returns the view."""
        try:
            self._load()
        except SourceGone as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - said in the view, which keeps what it shows
            self.error = f"cannot read experiment {self.name!r}: {_one_line(exc)}"
        return self

    def pick(self, variant: str) -> "ExperimentView":
        """Compare ``variant`` with the first variant; returns the view."""
        if variant not in self.variants[1:]:
            raise ValueError(_not_compared(variant, self.name, self.variants))
        self.variant = variant
        return self

    def select(self, turn_id: int | None) -> dict[str, Any]:
        """Show one case (``None`` closes it); returns ``detail``."""
        self.selected = None if turn_id is None else int(turn_id)
        if self.error and self.selected is not None and not self.detail:
            raise LookupError(self.error)
        return self.detail

    def open_trace(self, turn_id: int | None = None) -> TraceWidget:
        """Open the case ``turn_id`` (default: the selected one) in the trace view, its session
        stepped to that turn; the view holds it in ``trace`` (shown under the table) and
        returns it."""
        target = self.selected if turn_id is None else int(turn_id)
        if target is None:
            raise ValueError("no case is selected; select one before opening it in the trace")
        store = self._store
        turn = store.turn(int(target))
        if turn is None:
            raise LookupError(f"turn #{target} is no longer in the store")
        if self.trace is not None and self.trace.session_id == turn["session_id"]:
            self.trace.select(int(target))
        else:
            old = self.trace
            self.trace = TraceWidget(store, turn["session_id"])
            self.trace.select(int(target))
            if old is not None:
                old.close()
        return self.trace

    @_reacts("name", failing="cannot open the experiment")
    def _on_name(self, change: Any) -> None:
        if change["new"] != change["old"]:
            self._ready = False
            self.offset = 0
            self.selected = None
            self.detail = {}
            self.variant = ""
            self._ready = True
            self._load()

    @traitlets.validate("variant")
    def _check_variant(self, proposal: Any) -> str:
        value = proposal["value"]
        if self._ready and self.variants and value not in self.variants[1:]:
            raise traitlets.TraitError(_not_compared(value, self.name, self.variants))
        return value

    @_reacts("variant", "sort", "offset", "page_size", failing="cannot show the cases")
    def _on_view_choice(self, change: Any) -> None:
        if change["name"] in ("variant", "sort"):
            self._ready = False
            self.offset = 0
            self._ready = True
        self._page()

    @traitlets.observe("selected")
    def _on_selected(self, change: Any) -> None:
        if not self._ready:
            return
        try:
            self._load_detail()
            self.error = ""
        except SourceGone as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - said in the view; the selection goes back
            self._selection_failed(change, exc, said=LookupError)

    @_reacts("trace_requests", failing="cannot open the case in the trace")
    def _on_trace_request(self, _change: Any) -> None:
        self.open_trace()

    # -- following ------------------------------------------------------------------------
    @traitlets.observe("follow")
    def _on_follow(self, change: Any) -> None:
        if change["new"]:
            self.refresh()
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._poll_loop, daemon=True,
                                                name="metaclaw-experiment-view")
                self._thread.start()
        else:
            self._stop.set()

    def _signature(self) -> tuple[Any, ...]:
        """What changes when a result is stored or replaced (a failed replay run again)."""
        row = self._store.query(
            "SELECT COUNT(*) AS n, MAX(r.created_at) AS at FROM experiment_results r JOIN "
            "experiments e ON e.id = r.experiment_id WHERE e.name = ?", (self.name,))[0]
        return (self.name, row["n"], row["at"])

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._poll):
            if self._released or not self.follow:
                return
            try:
                if self._signature() != self._seen:
                    self.refresh()
            except SourceGone as exc:
                self.error = str(exc)
                return
            except Exception as exc:  # noqa: BLE001 - said in the view; polling stops
                self.error = f"stopped following the experiment: {_one_line(exc)}"
                return

    def close(self) -> None:
        """Close the view (its trace view and the workspace kept open for it after
        ``%metaclaw stop``, when it is the last widget showing it)."""
        self._stop.set()
        self.follow = False
        if self.trace is not None:
            self.trace.close()
        super().close()

    # -- display --------------------------------------------------------------------------
    def _pin_line(self) -> str:
        if self.follow:
            return "following the experiment: new results show as they are stored"
        return (f"pinned: results as of {time.strftime('%H:%M:%S', time.localtime(self.taken_at))}"
                "; press refresh (or tick follow) to read newer ones")

    def _repr_html_(self, limit: int = 50) -> str:
        first = self.variants[0] if self.variants else ""
        head = "".join(f"<th>{c}</th>" for c in (
            "variant", "cases", "scored", "mean reward", "pass rate", f"difference vs {first}",
            "95% interval", "McNemar p"))
        body = "".join(
            f"<tr><td><b>{_esc(s['variant'])}</b></td><td>{s['cases']}</td><td>{s['scored']}</td>"
            f"<td>{_fmt_num(s['mean_reward'])}</td>"
            f"<td>{'—' if s['pass_rate'] is None else format(s['pass_rate'], '.0%')}</td>"
            f"<td>{_fmt_num(s['diff_vs_first'])}</td>"
            f"<td>{'—' if s['diff_low'] is None else _fmt_num(s['diff_low']) + ' to ' + _fmt_num(s['diff_high'])}</td>"
            f"<td>{_fmt_p(s['mcnemar_p'])}</td></tr>" for s in self.summary)
        case_head = "".join(f"<th>{_esc(c)}</th>" for c in (
            ["case", "task"] + list(self.variants) + [f"{self.variant} − {first}"]))
        case_body = []
        for r in self.rows[:limit]:
            cells = []
            for spec in self.variants:
                v = r["by"].get(spec)
                cells.append("<td>not run</td>" if v is None else
                             f"<td>{_esc(v['verdict'] or 'failed')} {_fmt_reward(v['score']) if v['score'] is not None else ''}</td>")
            case_body.append(f"<tr><td>#{r['turn_id']}</td><td>{_esc(_short(r['task'] or '', 70))}"
                             f"</td>{''.join(cells)}<td>{_fmt_num(r['difference'])}</td></tr>")
        parts = [f"<div class='metaclaw-experiment-static'><b>Experiment {_esc(self.name)}</b> "
                 f"&middot; dataset {_esc(self.dataset)} ({self.total} cases) &middot; variants "
                 f"{_esc(', '.join(self.variants))}",
                 f"<div style='color:#656d76;font-size:90%'>{_esc(self._pin_line())} &middot; "
                 f"{_esc(self.plan)}</div>"]
        if self.error:
            parts.append(f"<p style='color:#cf222e'>{_esc(self.error)}</p>")
        parts.append(f"<table><tr>{head}</tr>{body}</table>")
        parts.append(f"<div style='overflow:auto;max-height:360px'><table><tr>{case_head}</tr>"
                     f"{''.join(case_body)}</table></div>")
        if self.total > len(self.rows[:limit]):
            parts.append(f"<p>(cases {self.offset + 1} to {self.offset + len(self.rows[:limit])}"
                         f" of {self.total}; <code>view.frame</code> holds every result)</p>")
        if self.detail:
            parts.append(_case_html(self.detail))
        parts.append("</div>")
        return "".join(parts)

    def __repr__(self) -> str:
        return (f"ExperimentView({self.name!r}: {self.total} cases, variants {self.variants}, "
                f"comparing {self.variant!r} with {self.variants[0] if self.variants else ''!r})")


def _case_html(detail: dict[str, Any]) -> str:
    parts = [f"<details open><summary><b>Case: turn #{detail['turn_id']}</b> &middot; session "
             f"{_esc(str(detail.get('session_id')))} &middot; recorded reward "
             f"{_fmt_reward(detail.get('recorded_reward'))}</summary>"
             f"<p><i>Task:</i> {_esc(detail.get('task') or '')}</p>"]
    for v in detail.get("variants") or []:
        if not v.get("run"):
            parts.append(f"<div><b>{_esc(v['variant'])}</b>: not run yet</div>")
            continue
        skills = ", ".join(v.get("skills") or []) or "no skill"
        parts.append(f"<div><b>{_esc(v['variant'])}</b> &middot; {_esc(v.get('verdict') or 'failed')}"
                     f" {_fmt_reward(v.get('score')) if v.get('score') is not None else ''} &middot; "
                     f"skills: {_esc(skills)}"
                     + (f" &middot; <span style='color:#cf222e'>{_esc(v['error'])}</span>"
                        if v.get("error") else "")
                     + (f"<pre style='white-space:pre-wrap'>{_esc(v['reply'])}</pre>"
                        if v.get("reply") else "")
                     + "".join(f"<pre style='white-space:pre-wrap'>{_esc(_call_text(c))}</pre>"
                               for c in v.get("tool_calls") or [])
                     + "</div>")
    parts.append("</details>")
    return "".join(parts)


def _call_text(call: Any) -> str:
    """A tool call as one readable line: ``name({arguments})``, the arguments shortened."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return _short(str(call), 600)
    return f"{fn.get('name')}({_short(str(fn.get('arguments') or ''), 600)})"


# -- per-skill evidence --------------------------------------------------------------------
#: The skill_stats columns the evidence view sends to the front-end.
EVIDENCE_COLUMNS = ("skill", "in_library", "injected", "judged_with", "sessions_with",
                    "reward_with", "pass_rate_with", "labels_pass_with", "labels_fail_with",
                    "comparable", "judged_without", "sessions_without", "reward_without",
                    "reward_delta", "delta_low",
                    "delta_high", "first_used", "last_used", "counted_since", "turns_since",
                    "nearest", "nearest_cosine", "suggestion")


class EvidenceView(_WorkspaceWidget):
    """Per-skill evidence (:func:`metaclaw.fastloop.evidence.skill_stats`): one row per skill, the
    suggestions (retire, merge, review) with their reasons, and :meth:`propose` to file them
    as proposals held for review. ``threshold``, ``retriever``, ``compare``, ``all_versions``: as
    for ``skill_stats``. A snapshot: :meth:`refresh` (or the *refresh* button) reads it again."""

    _esm = ESM
    _css = CSS

    view = traitlets.Unicode("evidence").tag(sync=True)
    rows = traitlets.List(traitlets.Dict()).tag(sync=True)
    suggestions = traitlets.List(traitlets.Dict()).tag(sync=True)
    generation = traitlets.Int(0).tag(sync=True)
    propose_requests = traitlets.Int(0).tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    taken_at = traitlets.Float(0.0).tag(sync=True)

    def __init__(self, store: Any, library: Any, *, threshold: float = 0.0,
                 retriever: Any = None, compare: bool = True, all_versions: bool = False,
                 **kwargs: Any):
        self._read_from(store)
        self._library = library
        self._options = {"threshold": threshold, "retriever": retriever, "compare": compare,
                         "all_versions": all_versions}
        self.stats: Any = None
        super().__init__(**kwargs)
        self._ready = True
        self._load()

    def _load(self) -> None:
        from metaclaw.fastloop import evidence

        library = self._lib()
        stats = evidence.skill_stats(library.store, library, **self._options)
        self.stats = stats
        rows = [{k: row[k] for k in EVIDENCE_COLUMNS} for row in stats.iter_rows(named=True)]
        for row in rows:
            for key in ("first_used", "last_used", "counted_since"):
                row[key] = None if row[key] is None else row[key].timestamp()
        self.rows = _json_safe(rows)
        self.suggestions = _json_safe([
            {"skill": row["skill"], "suggestion": row["suggestion"],
             "reason": evidence._reason(row)}
            for row in stats.iter_rows(named=True) if row["suggestion"]])
        self.generation = int(library.generation)
        self.taken_at = time.time()
        self.error = ""

    def refresh(self) -> "EvidenceView":
        """Compute the evidence again; returns the view."""
        try:
            self._load()
        except SourceGone as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - said in the view, which keeps what it shows
            self.error = f"cannot compute the per-skill evidence: {_one_line(exc)}"
        return self

    def propose(self) -> list[int]:
        """File the suggestions as proposals held for review (a skill with a held proposal
        gets no second one); returns the new proposals' ids."""
        from metaclaw.fastloop import evidence

        library = self._lib()
        ids = evidence.propose(library.store, library, self.stats)
        self.message = (f"filed proposal{'s' if len(ids) > 1 else ''} "
                        f"{', '.join('#' + str(i) for i in ids)}, held for review "
                        "(%metaclaw proposals)" if ids else
                        "no new proposal: no suggestion, or each already has a held proposal")
        return ids

    @_reacts("propose_requests", failing="the suggestions were not filed")
    def _on_propose(self, _change: Any) -> None:
        self.propose()

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in (
            "skill", "injected", "reward with (judged / sessions)",
            "comparable turns: reward (judged / sessions)",
            "difference (95% interval)", "labels pass/fail", "nearest", "suggestion"))
        body = []
        for r in self.rows:
            interval = ("" if r["delta_low"] is None else
                        f" ({_fmt_num(r['delta_low'])} to {_fmt_num(r['delta_high'])})")
            body.append(
                f"<tr><td><b>{_esc(r['skill'])}</b>{'' if r['in_library'] else ' (removed)'}</td>"
                f"<td>{r['injected']}</td><td>{_fmt_num(r['reward_with'])} "
                f"({r['judged_with']} / {r['sessions_with']})</td>"
                f"<td>{_fmt_num(r['reward_without'])} ("
                + ("—" if r["judged_without"] is None else
                   f"{r['judged_without']} / {r['sessions_without']}") + ")</td>"
                f"<td>{_fmt_num(r['reward_delta'])}{interval}</td>"
                f"<td>{r['labels_pass_with']}/{r['labels_fail_with']}</td>"
                f"<td>{_esc(r['nearest'] or '—')}"
                f"{'' if r['nearest_cosine'] is None else ' (' + format(r['nearest_cosine'], '.2f') + ')'}</td>"
                f"<td>{_esc(r['suggestion'] or '')}</td></tr>")
        parts = [f"<div class='metaclaw-evidence-static'><b>Per-skill evidence</b> &middot; "
                 f"skill generation {self.generation} &middot; {len(self.rows)} skills "
                 "&middot; <i>observational: turns with a skill against comparable turns "
                 "without it, not an experiment</i>"]
        if self.error:
            parts.append(f"<p style='color:#cf222e'>{_esc(self.error)}</p>")
        parts.append(f"<table><tr>{head}</tr>{''.join(body)}</table>" if self.rows
                     else "<p>No skills yet.</p>")
        if self.suggestions:
            parts.append("<p><b>Suggestions</b> (applied only as proposals you review):</p><ul>"
                         + "".join(f"<li>{_esc(s['reason'])}</li>" for s in self.suggestions)
                         + "</ul>")
        else:
            parts.append("<p>No suggestion to retire, merge or review a skill.</p>")
        if self.message:
            parts.append(f"<p>{_esc(self.message)}</p>")
        parts.append("</div>")
        return "".join(parts)

    def __repr__(self) -> str:
        return (f"EvidenceView({len(self.rows)} skills, {len(self.suggestions)} suggestions, "
                f"generation {self.generation})")


def evidence_view(store: Any, library: Any, **options: Any) -> EvidenceView:
    """The per-skill evidence of ``library``'s skills in ``store`` (see :class:`EvidenceView`)."""
    return EvidenceView(store, library, **options)


def show_experiment(name: str | None = None, *, store: Any, variant: str | None = None,
                    follow: bool = False) -> ExperimentView:
    """What ``%metaclaw experiment [NAME] [--variant V] [--follow]`` shows: the experiment
    ``name`` of ``store`` (default: the most recent). Raises
    :class:`metaclaw.fastloop.experiments.ExperimentError` (one sentence, naming the known experiments)
    when there is none of that name."""
    return ExperimentView(store, name, variant=variant, follow=follow)


__all__ = ["ExperimentView", "EvidenceView", "evidence_view", "show_experiment"]
