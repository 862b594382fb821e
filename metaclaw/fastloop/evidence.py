"""Per-skill evidence: which skills are used, and do the turns that get them go better?

    from metaclaw.fastloop import evidence
    stats = evidence.skill_stats(store, library)     # a polars DataFrame, one row per skill
    evidence.chart(stats)                            # reward with vs without, per skill
    evidence.propose(store, library, stats)          # held proposals for the suggestions

For each skill of the library (and each skill turns received that has left it since), over the
task turns served since its **current version** began (``counted_since``: when it was added, or
a change last rewrote what a turn given it reads, its description or body; a change of its
retrieval keys alone starts no version), the earlier versions' turns left out (``all_versions``
counts every version since it was last added, on both sides):

- **with**: the task turns it was injected into: how many, how many were judged and the sessions
  those came from, their mean reward and pass rate (reward above ``threshold``), the human labels
  (pass / fail), the first and last time it was used;
- **without (comparable turns)**: the task turns served while the skill was in the library
  (since its version began) whose recorded retrieval query the skill matches but which did not
  get it. An ask matches a skill when the proxy's default retrieval scores the pair at or above
  its injection threshold (BM25 fused with the static embedding of the skill's text or example
  asks, :class:`metaclaw.skills.retrieval.HybridRetriever`), whatever the top-k, the margin and
  the context budget decided: asks where another skill took its place, or that a scope, a stage
  or the budget kept it from. Turns from before it existed are left out: they met other tasks
  and another policy, and they hold the very failures it was written from, which would make
  any skill look good (or, as tasks grow harder, bad); so are those of its earlier versions,
  on both sides: an edit that fixed a skill is not held against it by the turns it fixed. The
  same numbers as for *with*, and the difference in mean reward per judged turn with a 95%
  interval that counts sessions, not turns, as the independent units (see below);
- the nearest other skill of the library and their cosine (a near duplicate at
  :data:`NEAR_DUPLICATE` or more), and how many task turns arrived since its version began
  (``turns_since``);
- a suggestion: ``retire`` (not injected in :data:`IDLE_TURNS` or more task turns since its
  version began), ``merge`` (a near duplicate of another skill), ``review`` (its turns did worse
  than the comparable ones, the whole interval below zero), or nothing.

The interval: the turns of one session are not independent (an agent's tool loop sends its ask
many times, and they share a reward), so the session is the unit. The difference stays per
judged turn (of the two means shown); the variance of each side's mean is cluster-robust by
session (CR1: each session's residuals summed before squaring, so forty turns of two sessions
count as two observations, not forty), never below the variance of independent turns, and
Student's t takes the Welch-Satterthwaite degrees of freedom counted in sessions:
``sessions_with`` / ``sessions_without`` are the sample sizes that matter. With one turn per
session it is the per-turn Welch interval. A session with turns on both sides counts on each,
the sides taken as independent (where its turns share a reward, that errs wide).

What the numbers cannot show: this is observation, not an experiment. The comparable turns are
matched on the ask only, and they did not get the skill for a reason (another skill ranked
above it), so a difference may come from that. A turn counts for the version committed when it
was recorded (one served by the earlier version while the change landed counts for the new
one). Few judged sessions give a wide interval (or none, under two a side).
An experiment that replays the same turns with and without the skill answers the causal
question. Suggestions are never applied here: :func:`propose` files them as held proposals (with
their evidence), promoted or discarded by a person like any other
(:mod:`metaclaw.fastloop.proposals`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timezone
from typing import Any, Iterable

from metaclaw import jsonlib
from metaclaw.gctune import fewer_collections
from metaclaw.skills.library import Skill, SkillOp
from metaclaw.store import IN_IDS, Store, id_list
from metaclaw.turns import TASK_TURNS_SQL

#: Cosine between two skills' texts at or above which they are flagged as near duplicates.
NEAR_DUPLICATE = 0.9
#: Task turns since a skill was added, none of them given it, before ``retire`` is suggested.
IDLE_TURNS = 200
#: Turns read per batch when matching asks (bounds the memory: a batch's sessions but the
#: last are folded into per-skill sums when it is added).
BATCH = 5_000

COLUMNS = ("skill", "in_library", "injected", "judged_with", "sessions_with", "reward_with",
           "pass_rate_with", "labels_pass_with", "labels_fail_with", "comparable",
           "judged_without", "sessions_without", "reward_without", "pass_rate_without",
           "reward_delta", "delta_low", "delta_high", "first_used", "last_used",
           "counted_since", "turns_since", "nearest", "nearest_cosine", "suggestion")


@dataclass
class _Side:
    """The sums of one side (with / without) of one skill: over its turns, and over the
    sessions its judged turns came from (of each session's judged turns ``n`` and their summed
    reward ``r``: ``n * n``, ``n * r``, ``r * r``)."""

    turns: int = 0
    judged: int = 0
    reward: float = 0.0
    squares: float = 0.0
    passed: int = 0
    label_pass: int = 0
    label_fail: int = 0
    sessions: int = 0
    session_judged_sq: float = 0.0
    session_cross: float = 0.0
    session_reward_sq: float = 0.0

    def mean(self) -> float | None:
        return self.reward / self.judged if self.judged else None

    def variance(self) -> float | None:
        """The variance of one judged turn's reward (the turns taken as independent)."""
        if self.judged < 2:
            return None
        mean = self.reward / self.judged
        return max(0.0, (self.squares - self.judged * mean * mean) / (self.judged - 1))

    def mean_variance(self) -> float | None:
        """The variance of :meth:`mean`, cluster-robust by session (CR1: each session's
        residuals ``r - n * mean`` summed before squaring, times ``G / (G - 1)`` for ``G``
        sessions), and never below the one of independent turns (a few sessions whose means
        happen to agree would otherwise claim none); None under 2 sessions."""
        per_turn = self.variance()
        if per_turn is None or self.sessions < 2:
            return None
        mean = self.reward / self.judged
        residuals = (self.session_reward_sq - 2 * mean * self.session_cross
                     + mean * mean * self.session_judged_sq)
        clustered = self.sessions / (self.sessions - 1) * max(0.0, residuals) / self.judged ** 2
        return max(clustered, per_turn / self.judged)


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified
    Lentz), from the side where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                     + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for step in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                     -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + step * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + step / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * fraction


def _t975(df: float) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (1 or more; Welch's
    need not be whole): where the upper tail, ``I_{df/(df+t^2)}(df/2, 1/2) / 2``, is 2.5%, found
    by bisection."""
    v = max(float(df), 1.0)
    low, high = 0.0, 100.0  # 12.71 at 1 degree of freedom, the widest
    for _ in range(100):
        t = (low + high) / 2
        if _betainc(v / 2, 0.5, v / (v + t * t)) / 2 > 0.025:
            low = t
        else:
            high = t
    return (low + high) / 2


def _interval(with_: _Side, without: _Side) -> tuple[float | None, float | None, float | None]:
    """Difference of the mean rewards per judged turn and its 95% interval, the session the unit
    of independence: Welch's form on each side's cluster-robust variance of its mean
    (:meth:`_Side.mean_variance`), Student's t with the Welch-Satterthwaite degrees of freedom
    counted in sessions (None where a side has < 2 sessions).

    Cluster-robust variances keep the difference per turn, the same means the columns show
    (per-session means would weigh a session of one turn like one of fifty), and with one turn
    per session they are exactly the per-turn Welch interval."""
    a, b = with_.mean(), without.mean()
    if a is None or b is None:
        return None, None, None
    ea, eb = with_.mean_variance(), without.mean_variance()
    if ea is None or eb is None:
        return a - b, None, None
    if ea + eb == 0:  # every reward alike on both sides: no spread to draw an interval from
        return a - b, a - b, a - b
    df = (ea + eb) ** 2 / (ea * ea / (with_.sessions - 1) + eb * eb / (without.sessions - 1))
    half = _t975(df) * math.sqrt(ea + eb)
    return a - b, a - b - half, a - b + half


def _added_at(store: Store) -> dict[str, float]:
    """When each skill name was last added to the library (its latest ``add`` event)."""
    rows = store.query("SELECT skill_name, MAX(created_at) AS at FROM skill_events "
                       "WHERE op = 'add' GROUP BY skill_name")
    return {r["skill_name"]: r["at"] for r in rows}


def _served(skill: Skill) -> tuple[str, str]:
    """What a turn given ``skill`` reads of it (its section of the injected block)."""
    return skill.description, skill.body


def version_starts(store: Store, library: Any, skills: list[Skill]) -> dict[str, float]:
    """When each of ``skills`` (as they are now) took its current version: the time of its
    latest ``add``, or of a later ``edit`` that changed what a turn given it reads (its
    description or body: an edit of its retrieval keys alone starts no version). A skill with
    neither recorded is absent (every turn counts). ``library``: where the generations'
    skills are read (:meth:`SkillLibrary.snapshot`), only for the edits newer than a skill's
    version."""
    from metaclaw.skills.library import SkillNotFound

    current = {s.name: _served(s) for s in skills}
    starts: dict[str, float] = {}
    rows = store.query("SELECT e.skill_name, e.op, e.generation, e.created_at, g.parent "
                       "FROM skill_events e LEFT JOIN skill_generations g "
                       "ON g.generation = e.generation WHERE e.op IN ('add', 'edit') "
                       "ORDER BY e.generation DESC, e.id DESC")
    for row in rows:  # newest first: each skill's version is found at its newest change
        name = row["skill_name"]
        if name not in current or name in starts:
            continue
        if row["op"] == "edit":
            parent = row["parent"] if row["parent"] is not None else row["generation"] - 1
            try:
                before = library.snapshot(parent).get(name)
            except SkillNotFound:
                before = None
            if before is not None and _served(before) == current[name]:
                continue  # its keys changed, not what a turn reads
        starts[name] = row["created_at"]
    return starts


def _task_turns(store: Store, columns: str) -> Iterable[list[tuple[Any, ...]]]:
    """The successful task turns (rows of ``id, session_id, turn_index, columns``, JSON as
    stored), ``BATCH`` at a time, a session's turns together (in the order of the index on
    ``session_id, turn_index``), so that a session is complete once a later one is read."""
    last: tuple[Any, ...] = ("", -1, 0)
    while True:
        rows = store.raw(f"SELECT id, session_id, turn_index, {columns} FROM turns WHERE "
                         f"{TASK_TURNS_SQL} AND status = 'ok' AND (session_id, turn_index, id) "
                         f"> (?, ?, ?) ORDER BY session_id, turn_index, id LIMIT {BATCH}", last)
        if not rows:
            return
        yield rows
        last = (rows[-1][1], rows[-1][2], rows[-1][0])


#: The columns of the task turns a scan reads (after ``id, session_id, turn_index``).
_READ = "created_at, injected_skills, reward, human_label, retrieval_query"
#: The sums kept per skill and side, in this order (rows of :class:`_Scan`'s arrays).
_SUMS = ("turns", "judged", "reward", "squares", "passed", "label_pass", "label_fail")
#: The sums over sessions kept per skill and side (:class:`_SessionSums`), in this order.
_SESSION_SUMS = ("sessions", "session_judged_sq", "session_cross", "session_reward_sq")


class _SessionSums:
    """Per skill (a column of :class:`_Scan`) and session, for one side: the judged turns and
    their summed reward, while the session may still have turns to come (sorted keys ``column
    << 32 | session``, two numbers each, the batches' cells merged in by :meth:`settle`); once
    it is complete (:meth:`fold`), its cells are added to the per-column sums of
    :data:`_SESSION_SUMS` and dropped, so what is kept grows with the skills, not the
    sessions."""

    def __init__(self) -> None:
        import numpy as np

        self.keys = np.zeros(0, dtype=np.int64)
        self.sums = np.zeros((2, 0))
        self.pending: list[tuple[Any, Any, Any]] = []
        self.folded = np.zeros((len(_SESSION_SUMS), 0))

    def add(self, column: Any, session: Any, judged: Any, reward: Any) -> None:
        """Add each judged turn (or, with ``judged`` -1, take it out again: in the same batch)
        to the sums of its skill's ``column`` and ``session`` (arrays alike in length)."""
        import numpy as np

        counted = judged != 0
        self.pending.append(((column[counted].astype(np.int64) << 32) | session[counted],
                             judged[counted], reward[counted]))

    def settle(self) -> None:
        """Merge the cells the batch added into those kept (the last session's, at most)."""
        import numpy as np

        if not self.pending:
            return
        keys, where = np.unique(np.concatenate([self.keys, *(k for k, _, _ in self.pending)]),
                                return_inverse=True)
        sums = np.stack([np.bincount(where.ravel(), minlength=len(keys), weights=np.concatenate(
                             [self.sums[i], *(p[i + 1] for p in self.pending)]))
                         for i in (0, 1)])
        self.pending = []
        kept = sums[0] > 0.5  # (a cell whose every turn went to the other side has none)
        self.keys, self.sums = keys[kept], sums[:, kept]

    def fold(self, before: int) -> None:
        """Add the cells of the sessions numbered below ``before`` (complete) to the
        per-column sums, and drop them."""
        import numpy as np

        self.settle()
        done = (self.keys & 0xFFFFFFFF) < before
        if not done.any():
            return
        column = self.keys[done] >> 32
        judged, reward = self.sums[:, done]
        width = max(self.folded.shape[1], int(column.max()) + 1)
        self.folded = np.pad(self.folded, ((0, 0), (0, width - self.folded.shape[1])))
        for k, weight in enumerate((np.ones_like(judged), judged * judged, judged * reward,
                                    reward * reward)):
            self.folded[k] += np.bincount(column, weights=weight, minlength=width)
        self.keys, self.sums = self.keys[~done], self.sums[:, ~done]

    def per_column(self, width: int) -> Any:
        """Per column (``width`` of them), the sums of :data:`_SESSION_SUMS`: the sessions, and
        over them ``n * n``, ``n * r``, ``r * r`` of their judged turns ``n`` and reward ``r``."""
        import numpy as np

        self.fold(1 << 32)  # every session: the scan is over
        out = np.zeros((len(_SESSION_SUMS), width))
        kept = min(width, self.folded.shape[1])
        out[:, :kept] = self.folded[:, :kept]
        return out


class _Scan:
    """What one scan of the task turns adds up, a batch of turns at a time (:func:`collect`):

    - ``with``: per skill name a turn was given (the library's skills first, then the names
      that have left it), the sums of :data:`_SUMS` and of :data:`_SESSION_SUMS`, and the first
      and last time;
    - ``without`` (with a ``matcher``): per skill of the library, the same sums over the turns
      whose ask the matcher scores at or above its injection threshold but which did not get it;
    - ``after``: how many turns were recorded after each of ``times`` (the times skills were
      added).
    """

    def __init__(self, skills: list[Skill], threshold: float, since: dict[str, float],
                 matcher: Any):
        import numpy as np

        self.skills, self.threshold, self.matcher = skills, threshold, matcher
        self.column = {s.name: i for i, s in enumerate(skills)}
        self.with_sums = np.zeros((len(_SUMS), len(skills)))
        self.first = np.full(len(skills), np.inf)
        self.last = np.full(len(skills), -np.inf)
        self.without = np.zeros((len(_SUMS), len(skills))) if matcher is not None else None
        self.with_sessions = _SessionSums()
        self.without_sessions = _SessionSums() if matcher is not None else None
        # the number the sums of the session read last use (by its id), and how many were read
        self.session_number: dict[str, int] = {}
        self.sessions_seen = 0
        self.times = np.array(sorted(set(since.values())), dtype=np.float64)
        self.after = np.zeros(len(self.times) + 1, dtype=np.int64)
        # a turn counts for a skill only from its start on (``since``: its version's, or when
        # it was last added): before, the asks of its kind met other tasks, another policy, the
        # very failures it was written from, or another text of it. A skill's rank: how many of
        # ``times`` are at or before its own (0: no start recorded, always in); a turn's: how
        # many are at or before the turn.
        self.rank = np.array([np.searchsorted(self.times, since[s.name], side="right")
                              if s.name in since else 0 for s in skills], dtype=np.intp)
        self._names: dict[str, list[int]] = {}  # an injected list as stored: its columns

    def _columns(self, raw: str) -> list[int]:
        columns = self._names.get(raw)
        if columns is None:
            columns = []
            for name in dict.fromkeys(_names(raw)):  # a name listed twice counts once
                if name not in self.column:
                    self.column[name] = len(self.column)
                columns.append(self.column[name])
            if len(self._names) < 10_000:
                self._names[raw] = columns
        return columns

    def add(self, store: Store, rows: list[tuple[Any, ...]]) -> None:
        """Add one batch of turns (rows of ``id`` and the columns of :data:`_READ`)."""
        import numpy as np

        ids, sessions, _, created, injected, rewards, labels, asked = zip(*rows)
        # numbered in the order read (a session's turns together): all but the batch's last
        # session are complete once it is added
        numbers = self.session_number
        session = np.empty(len(rows), dtype=np.int64)
        for i, name in enumerate(sessions):
            number = numbers.get(name)
            if number is None:
                number = numbers[name] = self.sessions_seen
                self.sessions_seen += 1
            session[i] = number
        self.session_number = {sessions[-1]: int(session[-1])}
        created = np.array(created, dtype=np.float64)
        # turns after each time: a turn counts for every time before its own
        self.after += np.bincount(np.searchsorted(self.times, created, side="left"),
                                  minlength=len(self.after))
        reward = np.array([r if r is not None else np.nan for r in rewards], dtype=np.float64)
        judged = ~np.isnan(reward)
        reward = np.nan_to_num(reward)
        values = np.stack([np.ones(len(rows)), judged, reward, reward * reward,
                           judged & (reward > self.threshold),
                           np.fromiter((lab == "pass" for lab in labels), bool, len(rows)),
                           np.fromiter((lab == "fail" for lab in labels), bool, len(rows))])
        turn, column = [], []  # one pair per skill a turn was given
        for r, raw in enumerate(injected):
            if raw and raw != "[]":
                for c in self._columns(raw):
                    turn.append(r)
                    column.append(c)
        turn, column = np.array(turn, dtype=np.intp), np.array(column, dtype=np.intp)
        span = np.searchsorted(self.times, created, side="right")
        ours = column < len(self.skills)  # a skill's turns before its start are not counted
        counted = ~ours  # (a name that left the library: all of them)
        counted[ours] = span[turn[ours]] >= self.rank[column[ours]]
        turn, column = turn[counted], column[counted]
        self._grow(len(self.column))
        for k in range(len(_SUMS)):
            self.with_sums[k] += np.bincount(column, weights=values[k, turn],
                                             minlength=len(self.column))
        np.minimum.at(self.first, column, created[turn])
        np.maximum.at(self.last, column, created[turn])
        judged_reward = values[1:3]
        self.with_sessions.add(column, session[turn], *judged_reward[:, turn])
        if self.without is not None:
            # summed per session and distinct ask in each span of time between two additions,
            # then multiplied by which skills each ask matches of those in the library then
            matched, ask = self._matched(store, ids, asked)
            local = np.unique(session, return_inverse=True)[1].ravel()  # numbered in the batch
            _, first, group = np.unique((span * len(matched) + ask) * (local.max() + 1) + local,
                                        return_index=True, return_inverse=True)
            group_span, group_ask, group_session = span[first], ask[first], session[first]
            per_group = np.stack([np.bincount(group.ravel(), weights=values[k],
                                              minlength=len(first))
                                  for k in range(len(_SUMS))])
            comparable = matched[group_ask] & (self.rank <= group_span[:, None])
            self.without += per_group @ comparable.astype(np.float64)
            judged_groups = np.flatnonzero(per_group[1])
            at, of = np.nonzero(comparable[judged_groups])  # (a judged group, a skill)
            at = judged_groups[at]
            self.without_sessions.add(of, group_session[at], *per_group[1:3, at])
            # a turn that got a skill its ask matches is on the other side: taken out again
            mine = column < len(self.skills)  # (each counted: from its skill's start on)
            hit = matched[ask[turn[mine]], column[mine]]
            took, skill = turn[mine][hit], column[mine][hit]
            for k in range(len(_SUMS)):
                self.without[k] -= np.bincount(skill, weights=values[k, took],
                                               minlength=len(self.skills))
            self.without_sessions.add(skill, session[took], *-judged_reward[:, took])
        # every session of the batch but its last is complete: its cells are summed up
        for sums in (self.with_sessions, self.without_sessions):
            if sums is not None:
                sums.fold(int(session[-1]))

    def _grow(self, width: int) -> None:
        import numpy as np

        extra = width - self.with_sums.shape[1]
        if extra > 0:
            self.with_sums = np.hstack([self.with_sums, np.zeros((len(_SUMS), extra))])
            self.first = np.concatenate([self.first, np.full(extra, np.inf)])
            self.last = np.concatenate([self.last, np.full(extra, -np.inf)])

    def _matched(self, store: Store, ids: tuple[int, ...], asked: tuple[str | None, ...]):
        """Per distinct ask and skill of the library: does the matcher score the ask at or
        above its injection threshold (a bool matrix whose last row, for the turns without
        an ask, matches nothing); and each turn's row in it."""
        import numpy as np

        from metaclaw.skills.retrieval import read_features

        first: dict[str, int] = {}
        for r, query in enumerate(asked):  # each distinct ask once: the first turn that asked it
            if query is not None:
                first.setdefault(query, ids[r])
        queries = list(first)
        floor = self.matcher.default_min_score
        if not queries:
            scores = np.zeros((0, len(self.skills)), dtype=np.float32)
        elif hasattr(self.matcher, "lexical"):
            # what the proxy recorded of each ask when it served the turn, not computed again
            # (read for the distinct asks only: an agent's tool loop sends one ask many times)
            recorded = dict(store.raw(f"SELECT id, ask_features FROM turns WHERE id {IN_IDS}",
                                      (id_list(first.values()),)))
            features = read_features(self.matcher, [recorded.get(i) for i in first.values()])
            scores = self.matcher.score_matrix(queries, self.skills, floor=floor,
                                               features=features)
        else:
            scores = self.matcher.score_matrix(queries, self.skills)
        table = np.vstack([scores >= floor, np.zeros((1, len(self.skills)), dtype=bool)])
        place = {q: i for i, q in enumerate(queries)}
        return table, np.array([place.get(q, len(queries)) for q in asked], dtype=np.intp)

    def result(self) -> dict[str, Any]:
        with_sessions = self.with_sessions.per_column(len(self.column))
        sides = {name: _side(self.with_sums[:, c], with_sessions[:, c])
                 for name, c in self.column.items() if self.with_sums[0, c]}
        used = {n: c for n, c in self.column.items() if n in sides}
        after = self.after[::-1].cumsum()[::-1]  # after[k]: turns after times[k - 1]
        since: dict[float | None, int] = {None: int(after[0])}
        since.update((float(t), int(after[k + 1])) for k, t in enumerate(self.times))
        return {"with": sides,
                "without": None if self.without is None else
                {s.name: _side(c, w) for s, c, w in zip(
                    self.skills, self.without.T,
                    self.without_sessions.per_column(len(self.skills)).T)},
                "first": {n: float(self.first[c]) for n, c in used.items()},
                "last": {n: float(self.last[c]) for n, c in used.items()},
                "since": since}


def _side(sums: Any, session_sums: Any) -> _Side:
    """A :class:`_Side` from its sums of :data:`_SUMS` and of :data:`_SESSION_SUMS`."""
    return _Side(int(sums[0]), int(sums[1]), float(sums[2]), float(sums[3]), int(sums[4]),
                 int(sums[5]), int(sums[6]), int(session_sums[0]), *map(float, session_sums[1:]))


def _names(raw: Any) -> list[str]:
    try:
        names = jsonlib.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except ValueError:
        return []
    return [n for n in names or () if isinstance(n, str)] if isinstance(names, list) else []


def _matcher(retriever: Any) -> Any:
    """The retriever that matches asks to skills (default: the proxy's default)."""
    if retriever is None:
        from metaclaw.skills.retrieval import make_retriever

        return make_retriever("auto")
    return retriever


def collect(store: Store, skills: list[Skill], *, threshold: float = 0.0,
            retriever: Any = None, compare: bool = True,
            since: dict[str, float] | None = None) -> dict[str, Any]:
    """The sums behind :func:`skill_stats`, from one scan of the task turns: ``with`` (by skill
    name), ``without`` (by skill of ``skills``; None without ``compare``), ``first`` / ``last``
    use, ``starts``: from when each skill of ``skills`` is counted (``since``, by name: its
    turns before are left out on both sides; default: when it was last added), and
    ``since``: the task turns recorded after each of those times (under ``None``: all of
    them)."""
    from metaclaw.skills.retrieval import one_blas_thread

    starts = _added_at(store) if since is None else since
    scan = _Scan(skills, threshold, starts, _matcher(retriever) if compare and skills else None)
    # products split over threads wait for busy cores; the batches' many row tuples would make
    # the cyclic collector run over and over
    with one_blas_thread(), fewer_collections():
        for rows in _task_turns(store, _READ):
            scan.add(store, rows)
    return {**scan.result(), "starts": starts}


def _nearest(skills: list[Skill], retriever: Any) -> list[tuple[str | None, float | None]]:
    """Each skill's most similar other skill (cosine of their texts)."""
    if len(skills) < 2:
        return [(None, None)] * len(skills)
    import numpy as np

    from metaclaw.skills.retrieval import skill_text

    matcher = _matcher(retriever)
    vectors = getattr(matcher, "dense", matcher)._encode([skill_text(s) for s in skills])
    similarity = vectors @ vectors.T
    np.fill_diagonal(similarity, -np.inf)
    best = similarity.argmax(axis=1)
    return [(skills[j].name, round(float(similarity[i, j]), 4)) for i, j in enumerate(best)]


def skill_stats(store: Store, library: Any, *, threshold: float = 0.0, retriever: Any = None,
                compare: bool = True, all_versions: bool = False):
    """One row per skill (see the module's docstring), the library's skills first, by name;
    ``threshold``: the reward above which a judged turn passed (the judge's); ``retriever``:
    the one that matches asks to skills (an embedding or hybrid retriever; default: the
    proxy's default); ``compare``: False skips the comparable turns and the near duplicates (no
    embedding at all); ``all_versions``: count every version of a skill since it was last added
    (default: its current version's turns only, :func:`version_starts`). A polars
    DataFrame."""
    import polars as pl

    skills = sorted(library.skills(), key=lambda s: s.name)
    since = None if all_versions else version_starts(store, library, skills)
    sums = collect(store, skills, threshold=threshold, retriever=retriever, compare=compare,
                   since=since)
    nearest = _nearest(skills, retriever) if compare else [(None, None)] * len(skills)
    starts = sums["starts"]
    gone = sorted(set(sums["with"]) - {s.name for s in skills})
    rows = []
    for name, in_library, near in [(s.name, True, n) for s, n in zip(skills, nearest)] + \
            [(n, False, (None, None)) for n in gone]:
        w = sums["with"].get(name, _Side())
        wo = sums["without"].get(name) if sums["without"] is not None and in_library else None
        delta, low, high = _interval(w, wo) if wo is not None else (None, None, None)
        since, start = None, None
        if in_library:
            start = starts.get(name)
            since = sums["since"][start]  # (None: all of them)
        suggestion = ""
        if in_library and w.turns == 0 and since is not None and since >= IDLE_TURNS:
            suggestion = "retire"  # (not given it since its start: its turns are from then)
        elif in_library and near[1] is not None and near[1] >= NEAR_DUPLICATE:
            suggestion = "merge"
        elif high is not None and high < 0:
            suggestion = "review"
        rows.append({
            "skill": name, "in_library": in_library, "injected": w.turns,
            "judged_with": w.judged, "sessions_with": w.sessions, "reward_with": w.mean(),
            "pass_rate_with": w.passed / w.judged if w.judged else None,
            "labels_pass_with": w.label_pass, "labels_fail_with": w.label_fail,
            "comparable": wo.turns if wo else None, "judged_without": wo.judged if wo else None,
            "sessions_without": wo.sessions if wo else None,
            "reward_without": wo.mean() if wo else None,
            "pass_rate_without": wo.passed / wo.judged if wo and wo.judged else None,
            "reward_delta": delta, "delta_low": low, "delta_high": high,
            "first_used": sums["first"].get(name), "last_used": sums["last"].get(name),
            "counted_since": start, "turns_since": since, "nearest": near[0],
            "nearest_cosine": near[1],
            "suggestion": suggestion,
        })
    schema = {"skill": pl.Utf8, "in_library": pl.Boolean, "injected": pl.Int64,
              "judged_with": pl.Int64, "sessions_with": pl.Int64, "reward_with": pl.Float64,
              "pass_rate_with": pl.Float64, "labels_pass_with": pl.Int64,
              "labels_fail_with": pl.Int64, "comparable": pl.Int64, "judged_without": pl.Int64,
              "sessions_without": pl.Int64, "reward_without": pl.Float64,
              "pass_rate_without": pl.Float64, "reward_delta": pl.Float64,
              "delta_low": pl.Float64, "delta_high": pl.Float64, "first_used": pl.Float64,
              "last_used": pl.Float64, "counted_since": pl.Float64, "turns_since": pl.Int64,
              "nearest": pl.Utf8,
              "nearest_cosine": pl.Float64, "suggestion": pl.Utf8}
    frame = pl.DataFrame(rows, schema=schema, orient="row") if rows else pl.DataFrame(
        schema=schema)
    return frame.with_columns(
        pl.from_epoch((pl.col(c) * 1000).cast(pl.Int64), time_unit="ms").alias(c)
        for c in ("first_used", "last_used", "counted_since"))


def _since(row: dict[str, Any]) -> str:
    """" since <when its counted turns start>" ("" where all of them count)."""
    start = row.get("counted_since")
    return "" if start is None else f" since {start:%Y-%m-%d %H:%M}"


def _reason(row: dict[str, Any]) -> str:
    if row["suggestion"] == "retire":
        return (f"retire {row['skill']}: not injected in {row['turns_since']} task turns"
                f"{_since(row)} (its current version)")
    if row["suggestion"] == "merge":
        return (f"merge {row['skill']} into {row['nearest']}: near duplicate (cosine "
                f"{row['nearest_cosine']:.2f}); edit {row['nearest']} to keep what it adds")
    return (f"review {row['skill']}: its {row['judged_with']} judged turns{_since(row)}, of "
            f"{row['sessions_with']} sessions, averaged {row['reward_with']:+.2f}, comparable "
            f"turns without it {row['reward_without']:+.2f} (of {row['sessions_without']} "
            f"sessions; difference {row['reward_delta']:+.2f}, 95% interval "
            f"{row['delta_low']:+.2f} to {row['delta_high']:+.2f}; observational)")


def propose(store: Store, library: Any, stats: Any) -> list[int]:
    """File each suggestion of ``stats`` (:func:`skill_stats`) as a proposal held for review: a
    ``remove`` of the skill, its reason saying what the evidence is, its evidence the latest
    judged turns that had it. Nothing changes in the library until a person promotes one
    (:func:`metaclaw.fastloop.proposals.promote`). A skill that has a held proposal already gets no
    second one. Returns the new proposals' ids."""
    from metaclaw.fastloop import proposals

    pending = {op.name for p in proposals.held(store) for op in p.ops}
    current = {s.name: s for s in library.skills()}
    ids = []
    for row in stats.filter(stats["suggestion"] != "").iter_rows(named=True):
        name = row["skill"]
        if name in pending or name not in current:
            continue
        start = row["counted_since"]  # the turns its figures are of
        evidence = [r["id"] for r in store.query(
            f"SELECT t.id FROM turns t, {store.json_values('t.injected_skills', 'j')} "
            "WHERE j.value = ? AND t.reward IS NOT NULL AND t.created_at >= ? "
            "ORDER BY t.id DESC LIMIT 20",
            # (the frame's times are UTC, without a zone: read as local, they moved by hours)
            (name, 0.0 if start is None else start.replace(tzinfo=timezone.utc).timestamp()))]
        op = SkillOp("remove", name=name, reason=_reason(row), evidence=evidence,
                     base=current[name].content_hash)
        ids.append(proposals.record(store, [op], origin="evidence", status=proposals.HELD,
                                    base_generation=library.generation, reason=_reason(row)))
    return ids


def chart(stats: Any):
    """An altair chart: each skill's mean reward with it and on comparable turns without it
    (the judged ones, and the sessions they came from), skills with no judged turn on either
    side left out."""
    import altair as alt

    rows = []
    for row in stats.iter_rows(named=True):
        for side, suffix in (("with the skill", "with"),
                             ("comparable turns without it", "without")):
            if row[f"reward_{suffix}"] is not None:
                rows.append({"skill": row["skill"], "side": side,
                             "reward": row[f"reward_{suffix}"],
                             "judged": row[f"judged_{suffix}"],
                             "sessions": row[f"sessions_{suffix}"]})
    return alt.Chart(alt.Data(values=rows)).mark_point(filled=True, size=80).encode(
        x=alt.X("reward:Q", title="mean judged reward", scale=alt.Scale(domain=[-1, 1])),
        y=alt.Y("skill:N", title=None), color=alt.Color("side:N", title=None),
        tooltip=["skill:N", "side:N", alt.Tooltip("reward:Q", format="+.2f"), "judged:Q",
                 "sessions:Q"],
    ).properties(title="Per-skill evidence (observational)")
