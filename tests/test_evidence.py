"""Per-skill evidence (metaclaw.fastloop.evidence): with / without counts, comparable turns
matched on the ask, the interval counting sessions as the independent units, suggestions filed
only as held proposals, the CLI view, bounded reads."""

from __future__ import annotations

import itertools
import json
import statistics
import time

import pytest
from polars.testing import assert_frame_equal

from metaclaw import cli
from metaclaw.fastloop import evidence, proposals
from metaclaw.skills.library import Skill, SkillLibrary
from metaclaw.store import Store

DATES = Skill(name="iso-dates", description="Write dates as ISO 8601 (YYYY-MM-DD)",
              body="Every date you write into a file uses the ISO 8601 form YYYY-MM-DD.")
BACKUP = Skill(name="backup-first", description="Copy a file to a .bak before editing it",
               body="Before you change a file, copy it to <name>.bak so the edit can be undone.")
UNUSED = Skill(name="haiku-replies", description="Answer poetry requests as a haiku",
               body="When asked for a poem, write a haiku of three lines.")


_TASKS = itertools.count()


def _turn(store: Store, ask: str, injected: list[str], reward: float | None,
          label: str | None = None, session: str | None = None) -> int:
    """Record a task turn: of ``session``, or (None) of a session of its own."""
    turn = store.record_turn(session_id=session or f"task-{next(_TASKS)}",
                             request_messages=[{"role": "user", "content": ask}],
                             status="ok", response="done", injected_skills=injected,
                             retrieval_query=ask)
    fields = {}
    if reward is not None:
        fields["reward"] = reward
    if label is not None:
        fields["human_label"] = label
    if fields:
        store.update_turn(turn, **fields)
    return turn


def _side(sessions: list[list[float]]) -> evidence._Side:
    """The sums of a side whose judged turns have these rewards, grouped by session."""
    rewards = [r for session in sessions for r in session]
    return evidence._Side(turns=len(rewards), judged=len(rewards), reward=sum(rewards),
                          squares=sum(r * r for r in rewards), sessions=len(sessions),
                          session_judged_sq=sum(len(s) ** 2 for s in sessions),
                          session_cross=sum(len(s) * sum(s) for s in sessions),
                          session_reward_sq=sum(sum(s) ** 2 for s in sessions))


def _welch(with_: list[float], without: list[float]) -> tuple[float, float, float]:
    """The difference of the mean rewards and its 95% Welch interval, every turn taken as
    independent."""
    ea, eb = (statistics.variance(side) / len(side) for side in (with_, without))
    df = (ea + eb) ** 2 / (ea * ea / (len(with_) - 1) + eb * eb / (len(without) - 1))
    delta = statistics.mean(with_) - statistics.mean(without)
    half = evidence._t975(df) * (ea + eb) ** 0.5
    return delta, delta - half, delta + half


EDIT = "edit config.yaml to raise the timeout"


def _backup_first(store: Store, library: SkillLibrary, with_: dict[str, list[float]],
                  without: dict[str, list[float]]) -> dict:
    """Record, per session, task turns asking EDIT with backup-first and without it (of the
    rewards given), and return backup-first's row of the evidence."""
    for given, sessions in ((["backup-first"], with_), ([], without)):
        for session, rewards in sessions.items():
            for reward in rewards:
                _turn(store, EDIT, given, reward, session=session)
    stats = evidence.skill_stats(store, library)
    return next(r for r in stats.iter_rows(named=True) if r["skill"] == "backup-first")


@pytest.fixture()
def backup_only(tmp_path):
    """A workspace whose library holds backup-first only, and no turn yet."""
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    library.add(BACKUP.with_retrieval_keys([EDIT]), reason="test")
    yield store, library
    store.close()


@pytest.fixture()
def workspace(tmp_path):
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    # before the skills existed: asks about dates that did badly
    for day in range(4):
        _turn(store, f"write the due date of task {day} into tasks.json as a date", [], -1.0)
    # written from those failures, it keeps their asks as its example asks (as the evolver does)
    library.add(DATES.with_retrieval_keys(["write the due date of task 0 into tasks.json as a "
                                           "date"]), reason="test")
    library.add(BACKUP.with_retrieval_keys(["edit config.yaml to raise the timeout"]),
                reason="test")
    library.add(UNUSED, reason="test")
    for day in range(5):
        _turn(store, f"put the deadline of item {day} into the json file as a date", ["iso-dates"],
              1.0, label="pass" if day == 0 else None)
    _turn(store, "edit config.yaml to raise the timeout", ["backup-first"], -1.0, label="fail")
    _turn(store, "edit settings.ini and change the port", ["backup-first"], -1.0)
    for day in range(2):  # since it exists: date asks another skill's turn took
        _turn(store, f"write the due date of task {day} into tasks.json as a date",
              ["backup-first"], -1.0)
    _turn(store, "what is the capital of France", [], None)
    _turn(store, "an old ask", ["retired-skill"], 1.0)
    yield store, library
    store.close()


def test_with_and_without_are_counted_per_skill(workspace):
    store, library = workspace
    stats = evidence.skill_stats(store, library)
    rows = {r["skill"]: r for r in stats.iter_rows(named=True)}
    assert list(stats.columns) == list(evidence.COLUMNS)
    dates = rows["iso-dates"]
    assert (dates["injected"], dates["judged_with"], dates["reward_with"]) == (5, 5, 1.0)
    assert dates["labels_pass_with"] == 1 and dates["pass_rate_with"] == 1.0
    # the date asks served since it exists are its comparable turns, never those from before
    # (other tasks, the very failures it was written from)
    assert dates["comparable"] == 2 and dates["reward_without"] == -1.0
    assert (dates["sessions_with"], dates["sessions_without"]) == (5, 2)  # a session each
    assert dates["reward_delta"] == 2.0 and dates["delta_low"] == 2.0  # no spread on a side
    assert dates["last_used"] is not None and dates["turns_since"] == 11
    backup = rows["backup-first"]
    assert (backup["injected"], backup["labels_fail_with"], backup["reward_with"]) == (4, 1, -1.0)
    unused = rows["haiku-replies"]
    assert unused["injected"] == 0 and unused["last_used"] is None
    gone = rows["retired-skill"]
    assert gone["in_library"] is False and gone["injected"] == 1 and gone["comparable"] is None
    assert [r["skill"] for r in stats.iter_rows(named=True)][-1] == "retired-skill"


def test_without_comparison_no_embedding_is_used(workspace, monkeypatch):
    store, library = workspace
    monkeypatch.setattr(evidence, "_matcher", lambda retriever: pytest.fail("embedded"))
    stats = evidence.skill_stats(store, library, compare=False)
    assert stats["comparable"].null_count() == len(stats)


def test_suggestions_and_proposals_held_for_review(workspace, monkeypatch):
    store, library = workspace
    monkeypatch.setattr(evidence, "IDLE_TURNS", 5)
    monkeypatch.setattr(evidence, "NEAR_DUPLICATE", 2.0)  # no merge suggestion here
    stats = evidence.skill_stats(store, library)
    suggestions = dict(zip(stats["skill"], stats["suggestion"]))
    assert suggestions["haiku-replies"] == "retire"
    assert suggestions["iso-dates"] == ""
    generation = library.generation
    filed = evidence.propose(store, library, stats)
    assert len(filed) == 1 and library.generation == generation  # nothing applied
    proposal = proposals.get(store, filed[0])
    assert proposal.status == proposals.HELD and proposal.origin == "evidence"
    assert proposal.ops[0].op == "remove" and proposal.ops[0].name == "haiku-replies"
    assert "not injected in 11 task turns since 20" in proposal.reason  # (its start's date)
    assert proposal.reason.endswith("(its current version)")
    assert evidence.propose(store, library, stats) == []  # already held: not filed twice
    proposals.promote(store, library, filed[0], by="alice")
    assert "haiku-replies" not in library


def test_merge_and_review_suggestions(workspace, monkeypatch):
    store, library = workspace
    library.add(Skill(name="iso-dates-again", description=DATES.description, body=DATES.body),
                reason="test")
    for _ in range(3):  # backup-first's turns do worse than the comparable edits without it
        _turn(store, "edit config.yaml to raise the timeout", [], 1.0)
    _turn(store, "edit config.yaml to raise the timeout", ["backup-first"], -0.9)
    stats = evidence.skill_stats(store, library)
    rows = {r["skill"]: r for r in stats.iter_rows(named=True)}
    assert rows["iso-dates-again"]["suggestion"] == "merge"
    assert rows["iso-dates-again"]["nearest"] == "iso-dates"
    assert rows["iso-dates-again"]["nearest_cosine"] > 0.99
    assert rows["backup-first"]["suggestion"] == "review"
    assert rows["backup-first"]["delta_high"] < 0
    filed = evidence.propose(store, library, stats)
    reasons = [proposals.get(store, i).reason for i in filed]
    assert any(r.startswith("review backup-first: its 5 judged turns since 20")
               and ", of 5 sessions," in r
               and "observational" in r for r in reasons)
    review = next(proposals.get(store, i) for i in filed
                  if proposals.get(store, i).ops[0].name == "backup-first")
    assert review.ops[0].evidence  # the judged turns that had it


def test_turns_of_few_sessions_are_not_taken_for_many(backup_only, monkeypatch):
    """Forty turns from two sessions a side, the sessions' rewards apart: taken as independent
    turns they give an interval clear of zero (and ``review``); counted by session, two a side
    show nothing either way. The same when a session's turns span batches."""
    store, library = backup_only
    with_ = {"w1": [-0.2, -0.4] * 10, "w2": [0.2, 0.0] * 10}  # mean -0.1
    without = {"o1": [0.6, 0.4] * 10, "o2": [0.2, 0.0] * 10}  # mean 0.3
    turns = [sum(sessions.values(), []) for sessions in (with_, without)]
    _, _, per_turn_high = _welch(*turns)
    assert per_turn_high < 0  # turns taken as independent
    row = _backup_first(store, library, with_, without)
    assert (row["judged_with"], row["sessions_with"]) == (40, 2)
    assert (row["judged_without"], row["sessions_without"]) == (40, 2)
    assert row["reward_delta"] == pytest.approx(-0.4)  # per turn
    assert row["delta_low"] < 0 < row["delta_high"] and row["suggestion"] == ""
    # each side's mean: variance 2 / 1 * (20 * 0.2) ** 2 * 2 / 40 ** 2 = 0.04, 2 sessions
    # a side give 2 degrees of freedom
    half = evidence._t975(2) * 0.08 ** 0.5
    assert row["delta_high"] - row["reward_delta"] == pytest.approx(half)
    whole = evidence.skill_stats(store, library)
    monkeypatch.setattr(evidence, "BATCH", 7)
    assert_frame_equal(evidence.skill_stats(store, library), whole)


def test_many_sessions_still_show_a_real_difference(backup_only):
    """Thirty sessions, each with three turns given the skill and three not (a session counts on
    both sides), the sessions' rewards apart: the interval is wider than the per-turn one, and
    still clear of zero."""
    store, library = backup_only
    effect = [0.2 * (g % 5 - 2) for g in range(30)]  # what each session's tasks add
    with_ = {f"t{g}": [0.4 + e + d for d in (-0.1, 0.0, 0.1)] for g, e in enumerate(effect)}
    without = {f"t{g}": [-0.2 + e + d for d in (-0.1, 0.0, 0.1)] for g, e in enumerate(effect)}
    row = _backup_first(store, library, with_, without)
    assert (row["sessions_with"], row["sessions_without"]) == (30, 30)
    assert row["reward_delta"] == pytest.approx(0.6)
    _, low, high = _welch(*(sum(sessions.values(), []) for sessions in (with_, without)))
    assert row["delta_high"] - row["delta_low"] > 1.5 * (high - low)
    assert 0 < row["delta_low"] < 0.6 < row["delta_high"]


def test_one_turn_per_session_gives_the_per_turn_interval(backup_only):
    """Where every session has one judged turn, the interval is the per-turn Welch interval."""
    store, library = backup_only
    with_ = [1.0, 0.5, -0.5, 1.0, 0.0, 0.8]
    without = [-1.0, 0.2, 0.5, -0.3]
    row = _backup_first(store, library, {f"w{i}": [r] for i, r in enumerate(with_)},
                        {f"o{i}": [r] for i, r in enumerate(without)})
    assert (row["sessions_with"], row["sessions_without"]) == (6, 4)
    expected = _welch(with_, without)
    assert (row["reward_delta"], row["delta_low"], row["delta_high"]) == pytest.approx(expected)
    assert evidence._interval(_side([[r] for r in with_]),
                              _side([[r] for r in without])) == pytest.approx(expected)


def test_cli_skills_stats(workspace, tmp_path, capsys):
    store, library = workspace
    argv = ["skills", "stats", "--db", str(store.target), "--skills", str(tmp_path / "skills")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "iso-dates" in out and "retired-skill (gone)" in out and "observational" in out
    assert cli.main(argv + ["--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["skill"] for r in rows} >= {"iso-dates", "backup-first", "haiku-replies"}
    iso = next(r for r in rows if r["skill"] == "iso-dates")
    (line,) = [line for line in out.splitlines() if line.startswith("iso-dates ")]
    # both sample sizes, with and without the skill: judged turns / their sessions
    assert line.count(" n=") == 2
    assert f"n={iso['judged_with']}/{iso['sessions_with']}" in line.split()
    assert f"n={iso['judged_without']}/{iso['sessions_without']}" in line.split()
    assert "the interval counts sessions" in out
    assert iso["counted_since"] is not None and line.split()[1] != "-"  # its version's start
    assert cli.main(argv + ["--all-versions", "--json"]) == 0
    assert {r["skill"] for r in map(json.loads, capsys.readouterr().out.splitlines())} >= {
        "iso-dates"}


def test_empty_workspace(tmp_path):
    store = Store(tmp_path / "metaclaw.db")
    library = SkillLibrary(tmp_path / "skills", store)
    stats = evidence.skill_stats(store, library)
    assert stats.is_empty() and list(stats.columns) == list(evidence.COLUMNS)
    assert evidence.propose(store, library, stats) == []
    store.close()


def test_turns_are_read_in_batches(workspace, monkeypatch):
    """Memory stays bounded: the turns are read BATCH at a time, never all at once."""
    store, library = workspace
    monkeypatch.setattr(evidence, "BATCH", 3)
    seen = []
    original = store.raw

    def raw(sql, params=()):
        rows = original(sql, params)
        if "FROM turns WHERE" in sql and "LIMIT" in sql:
            seen.append(len(rows))
        return rows

    monkeypatch.setattr(store, "raw", raw)
    kept = []  # the (skill, session) cells kept after each batch: the last session's at most
    add = evidence._Scan.add

    def counted_add(scan, *args):
        add(scan, *args)
        kept.append(len({int(k) & 0xFFFFFFFF for k in scan.with_sessions.keys}))

    monkeypatch.setattr(evidence._Scan, "add", counted_add)
    big = evidence.skill_stats(store, library)
    assert max(seen) <= 3 and sum(seen) == 15 and max(kept) <= 1
    monkeypatch.setattr(evidence, "BATCH", 5000)
    assert big.equals(evidence.skill_stats(store, library))


def test_chart(workspace):
    store, library = workspace
    spec = evidence.chart(evidence.skill_stats(store, library)).to_dict()
    sides = {v["side"] for v in spec["data"]["values"]}
    assert sides == {"with the skill", "comparable turns without it"}


def test_recorded_ask_features_give_the_same_evidence_as_computing_them(workspace):
    """The proxy records each ask's features (static embedding, BM25 terms) with its turn;
    evidence reads them for the distinct asks instead of embedding every ask again. Recorded,
    missing, damaged or computed with another table: the same numbers."""
    from metaclaw.skills.retrieval import ask_features, make_retriever

    store, library = workspace
    computed = evidence.skill_stats(store, library)
    retriever = make_retriever("auto")
    for row in store.raw("SELECT id, retrieval_query FROM turns"):
        store.execute("UPDATE turns SET ask_features = ? WHERE id = ?",
                      (ask_features(retriever, row[1]), row[0]))
    assert store.raw("SELECT COUNT(*) FROM turns WHERE ask_features IS NULL")[0][0] == 0
    assert evidence.skill_stats(store, library).equals(computed)
    # damaged and foreign records are computed afresh, never trusted
    first, second, third = [r[0] for r in store.raw("SELECT id FROM turns ORDER BY id LIMIT 3")]
    store.execute("UPDATE turns SET ask_features = 'static-0-000000000000\tzz\tdate' WHERE id = ?",
                  (first,))
    store.execute("UPDATE turns SET ask_features = substr(ask_features, 1, 40) WHERE id = ?",
                  (second,))
    (record,) = store.raw("SELECT ask_features FROM turns WHERE id = ?", (third,))[0]
    tag, vector, terms = record.split("\t")
    store.execute("UPDATE turns SET ask_features = ? WHERE id = ?",
                  ("\t".join([tag, "zz" + vector[2:], terms]), third))  # not hex
    assert evidence.skill_stats(store, library).equals(computed)


def test_the_proxy_records_each_asks_features_with_its_turn(workspace):
    """A task turn served at the default retrieval carries its ask's features, and they read
    back as the vector and terms the retriever computes for that ask; a retriever with no
    static embedding records none."""
    import openai

    from metaclaw.offline.double import DoubleServer, Reply
    from metaclaw.proxy.app import Proxy, ProxyConfig
    from metaclaw.skills.retrieval import (ask_features, make_retriever, query_terms,
                                           read_features)

    store, library = workspace
    ask = "put the deadline of item 7 into the json file as a date"
    with DoubleServer([Reply("Done.")]) as upstream, \
            Proxy(ProxyConfig(upstream_url=upstream.url, retrieval="auto", max_retries=0),
                  store, library) as proxy:
        openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="unused",
                      max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": ask}])
        proxy.flush()
    (recorded,) = [r[0] for r in store.raw(
        "SELECT ask_features FROM turns WHERE retrieval_query = ?", (ask,))]
    retriever = make_retriever("auto")
    (back,) = read_features(retriever, [recorded])
    assert abs(float(back.vector @ retriever.dense.embed_query(ask)) - 1.0) < 2e-3
    assert back.terms == query_terms(ask)
    assert read_features(retriever, [None, "not\tfeatures", recorded.replace("\t", " ")]) == \
        [None] * 3
    assert ask_features(retriever, "") is None
    assert ask_features(make_retriever("lexical"), ask) is None


def test_one_scan_counts_the_turns_after_each_time_a_skill_was_added(workspace):
    store, library = workspace
    times = [r[0] for r in store.raw("SELECT created_at FROM turns ORDER BY id")]
    library.add(Skill(name="late", description="a late skill", body="added last"), reason="t")
    added_times = times[::3] + times[:2]
    scan = evidence._Scan([], 0.0, {f"skill-{i}": t for i, t in enumerate(added_times)}, None)
    for rows in evidence._task_turns(store, evidence._READ):
        scan.add(store, rows)
    counts = scan.result()["since"]
    task = store.raw("SELECT created_at FROM turns WHERE turn_type = 'main' AND status = 'ok'")
    assert counts == {None: len(task),
                      **{t: sum(c > t for (c,) in task) for t in set(added_times)}}
    stats = evidence.skill_stats(store, library, compare=False)
    assert dict(zip(stats["skill"], stats["turns_since"]))["late"] == 0


def test_the_interval_is_students_t_and_a_skill_re_added_can_be_retired(workspace,
                                                                       monkeypatch):
    """Few judged turns get Student's t (Welch's degrees of freedom), not the normal's 1.96
    (an interval from 4 turns was half as wide as it should be); a skill removed and added
    again, not given since, is suggested for retirement (its old turns kept it in): they are
    counted for all its versions only."""
    with_ = _side([[1], [1], [-1]])  # one turn a session
    without = _side([[-1], [-1], [1]])
    delta, low, high = evidence._interval(with_, without)
    half = 2.776 * ((4 / 3) / 3 * 2) ** 0.5  # t(0.975, 4 df): both variances 4/3, n 3
    assert delta == pytest.approx(2 / 3) and high - delta == pytest.approx(half, rel=0.01)
    # the quantile itself, Welch's degrees of freedom need not be whole (a side of 2 turns gives
    # between 1 and 2, where an expansion about the normal was 6-11% short)
    for df, t in ((1, 12.7062), (1.5, 6.0167), (2, 4.3027), (5, 2.5706), (30, 2.0423),
                  (10_000, 1.9602)):
        assert evidence._t975(df) == pytest.approx(t, abs=1e-4)
    store, library = workspace
    monkeypatch.setattr(evidence, "IDLE_TURNS", 3)
    monkeypatch.setattr(evidence, "NEAR_DUPLICATE", 2.0)
    library.remove("iso-dates", reason="test")
    library.add(DATES, reason="test")  # back, and not given since
    for day in range(3):
        _turn(store, f"an unrelated ask {day}", [], None)
    rows = {r["skill"]: r for r in evidence.skill_stats(store, library).iter_rows(named=True)}
    assert rows["iso-dates"]["injected"] == 0 and rows["iso-dates"]["suggestion"] == "retire"
    assert rows["iso-dates"]["turns_since"] == 3
    pooled = evidence.skill_stats(store, library, all_versions=True)
    assert dict(zip(pooled["skill"], pooled["injected"]))["iso-dates"] == 0  # since added


def test_an_edited_skill_is_judged_on_its_current_version(backup_only, monkeypatch):
    """An evolver's edit of a failing skill: the earlier text's turns (bad, with and without
    it alike) are left out on both sides, so the edit is judged on the turns it served, and
    ``review`` comes from the new text's turns only. An edit of its retrieval keys alone
    starts no version; ``all_versions`` pools every version since it was added."""
    store, library = backup_only
    for session in range(3):  # the first text does worse than the comparable turns
        _turn(store, EDIT, ["backup-first"], -1.0, session=f"old-with-{session}")
        _turn(store, EDIT, [], 0.5, session=f"old-without-{session}")
    old_stats = evidence.skill_stats(store, library)
    old = {r["skill"]: r for r in old_stats.iter_rows(named=True)}
    assert old["backup-first"]["suggestion"] == "review"
    first = old["backup-first"]["counted_since"]
    keys_only = library.get("backup-first").with_retrieval_keys(["back up the nginx config"])
    library.edit(keys_only, reason="keys")
    same = {r["skill"]: r for r in evidence.skill_stats(store, library).iter_rows(named=True)}
    assert same["backup-first"]["counted_since"] == first  # what a turn reads did not change
    assert same["backup-first"]["injected"] == 3 and same["backup-first"]["comparable"] == 3
    fixed = library.get("backup-first")
    library.edit(Skill(name=fixed.name, description=fixed.description,
                       body=fixed.body + " Keep the copy until the edit is verified.",
                       extra=fixed.extra), reason="evolver: fix")
    for session in range(3):  # the new text does as well as the turns without it
        _turn(store, EDIT, ["backup-first"], 0.5, session=f"new-with-{session}")
        _turn(store, EDIT, [], 0.5, session=f"new-without-{session}")
    stats = evidence.skill_stats(store, library)
    row = next(r for r in stats.iter_rows(named=True) if r["skill"] == "backup-first")
    assert row["counted_since"] > first and row["turns_since"] == 6
    assert (row["injected"], row["sessions_with"], row["reward_with"]) == (3, 3, 0.5)
    assert (row["comparable"], row["sessions_without"], row["reward_without"]) == (3, 3, 0.5)
    assert row["reward_delta"] == 0.0 and row["suggestion"] == ""
    assert evidence.propose(store, library, stats) == []
    given = sorted(r["id"] for r in store.turns("reward IS NOT NULL AND injected_skills != '[]'"))
    for zone in ("America/New_York", "Asia/Tokyo"):  # the evidence of its version, anywhere
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        [filed] = evidence.propose(store, library, old_stats)  # (its turns since `first`)
        assert sorted(proposals.get(store, filed).ops[0].evidence) == given
        proposals.discard(store, filed, by="test", reason="test")
    monkeypatch.delenv("TZ")
    time.tzset()
    pooled = evidence.skill_stats(store, library, all_versions=True)
    row = next(r for r in pooled.iter_rows(named=True) if r["skill"] == "backup-first")
    assert row["counted_since"] == first and (row["injected"], row["comparable"]) == (6, 6)
    assert row["reward_with"] == pytest.approx(-0.25)
