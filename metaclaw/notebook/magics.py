"""``%metaclaw`` line magics (actions) and ``%%metaclaw`` cell magics (conversations).

    %load_ext metaclaw
    %metaclaw start --starter-skills          # offline double when no --upstream
    %%metaclaw chat
    Please back up config.yaml before editing it.
    %metaclaw skills
    %metaclaw trace                           # step through a session, label turns
    %metaclaw proposals                       # review what the verification gate held back
    %metaclaw stop

The magics only parse arguments, call the core library and return objects that render
themselves (``_repr_html_``, widgets, polars frames).
"""

from __future__ import annotations

import argparse
import html
import itertools
import keyword
import shlex
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from metaclaw import argtypes, cli
from metaclaw.store import BUSY_TIMEOUT_S, local_dir, lock_busy


def _without_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a word outside quotes (``%metaclaw start  # note``, as
    in Python); a ``#`` inside a word or quotes (a token, a URL fragment) is kept."""
    quote, escaped, word_start = None, False, True
    for i, char in enumerate(line):
        starts = word_start
        word_start = False
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char.isspace():
            word_start = True
        elif char == "#" and starts:
            return line[:i]
    return line


class MagicUsageError(Exception):
    """Raised for bad magic arguments; shown as one line, not a traceback."""


class MagicInterrupted(Exception):
    """The user stopped a call, which was cancelled before its end (:func:`metaclaw.aio.
    run_sync`); shown as one line saying what was kept."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would sys.exit() the kernel
        raise MagicUsageError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> None:
        if status == 0:  # --help, already printed: the call is over, and did not fail
            raise _HelpShown
        raise MagicUsageError(message or self.format_help())


class _HelpShown(Exception):
    """``--help`` printed the action's help: the magic returns nothing, the cell succeeds."""


def _count(text: str) -> int:
    """A ``--last N`` value: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: give a whole number, 0 or more")
    return value


def _positive(text: str) -> int:
    """A ``--max-tokens`` / ``--max-steps`` value: a whole number, 1 or more (0 would be read as
    "no limit" and a negative one sent upstream, which answers 400)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a limit: give a whole number, 1 or more")
    return value


def _parser(name: str, doc: str) -> _Parser:
    return _Parser(prog=f"%metaclaw {name}", description=doc, add_help=True)


def _start_parser() -> _Parser:
    """``%metaclaw start``'s options: those of ``metaclaw serve`` (both built from
    :class:`metaclaw.runtime.RuntimeConfig`), with the library's defaults (port 0: any free)."""
    parser = _parser("start", MetaClawMagics._do_start.__doc__)
    cli.add_config_options(parser, serve_defaults=False)
    return parser


#: Secondary text in an output: JupyterLab's theme colour (readable in light and dark themes).
_MUTED = "color:var(--jp-content-font-color2,#666)"


@dataclass
class ChatTurn:
    """One exchange sent from a ``%%metaclaw chat`` cell: the user's message, the final reply,
    every tool call made on the way (with its result when the magic ran it), and the recorded
    turn of each model call (``turns``; ``turn`` is the last one)."""

    session_id: str
    message: str
    reply: str
    tool_calls: list[dict[str, Any]]
    turns: list[dict[str, Any]]

    @property
    def turn(self) -> dict[str, Any] | None:
        return self.turns[-1] if self.turns else None

    @property
    def turn_ids(self) -> list[int]:
        return [t["id"] for t in self.turns]

    @property
    def injected_skills(self) -> list[str]:
        return list(self.turn["injected_skills"]) if self.turn else []

    def _repr_html_(self) -> str:
        skills = ", ".join(f"<code>{html.escape(s)}</code>" for s in self.injected_skills) \
            or "<em>none</em>"
        meta = ""
        if self.turn:
            meta = (f"turn #{self.turn['id']} · session <code>{html.escape(self.session_id)}</code>"
                    f" · skill generation {self.turn['skill_generation']} · "
                    f"policy v{self.turn['policy_version']} · {self.turn['latency_ms'] or 0:.0f} ms")
        calls = ""
        if self.tool_calls:  # folded: one line per call, its arguments and result on demand
            names: dict[str, int] = {}
            for call in self.tool_calls:
                names[call["function"]["name"]] = names.get(call["function"]["name"], 0) + 1
            counted = ", ".join(f"{html.escape(n)}" + (f" ×{k}" if k > 1 else "")
                                for n, k in names.items())
            n = len(self.tool_calls)
            calls = (f"<details><summary>{n} tool call{'' if n == 1 else 's'}: {counted}"
                     "</summary>" + "".join(_tool_call_html(c) for c in self.tool_calls)
                     + "</details>")
        return (
            "<div class='metaclaw-chat' style='border-left:3px solid #6a5acd;padding:4px 10px'>"
            f"<div style='white-space:pre-wrap'>{html.escape(self.reply)}</div>"
            + calls
            + f"<div style='{_MUTED};font-size:90%'>injected skills: {skills}<br>{meta}</div>"
            "</div>")

    def __repr__(self) -> str:
        return (f"{self.reply}\n-- injected skills: {', '.join(self.injected_skills) or 'none'}")


def _check_port_free(host: str, port: int, running: str) -> None:
    """:class:`MagicUsageError` where ``host:port`` cannot be bound now (the proxy at
    ``running`` is left as it is)."""
    import errno
    import os
    import socket

    try:  # every address the proxy would listen on (a name may have an IPv4 and an IPv6 one)
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except OSError:  # not resolvable here: the start itself says so
        return
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            if os.name != "nt":  # (on Windows it lets a port in use be bound)
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:  # a family not enabled here, as asyncio
                    continue  # skips it too
                raise MagicUsageError(f"%metaclaw start: cannot listen on {host}:{port} "
                                      f"({exc.strerror}); the proxy at {running} is still "
                                      "running") from None


def _said_unknown(store: Any, session: str | None, turn_ids: Any = ()) -> bool:
    """Say which of ``session`` and ``turn_ids`` (given to an action) the workspace does not
    hold, an id mistyped or of another workspace, rather than only counting them out; whether
    anything was said."""
    missing = [t for t in turn_ids if store.turn(t) is None]
    if missing:
        print(f"(no turn {', '.join(map(str, missing))} in the workspace)")
    unknown = bool(session) and store.session(session) is None
    if unknown:
        print(f"(no session {session!r} in the workspace)")
    return bool(missing) or unknown


class _Status:
    """``%metaclaw status``: the runtime's status as a table, and as text where no HTML is shown
    (nbconvert, CI logs), read when shown."""

    def __init__(self, runtime: Any):
        self.runtime = runtime

    def _repr_html_(self) -> str:
        return self.runtime._repr_html_()

    def __repr__(self) -> str:
        rows = self.runtime.status()
        width = max(map(len, rows))
        return "MetaClaw runtime\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows.items())


def _pretty(text: Any) -> str:
    """A tool call's arguments or result: indented JSON when it is JSON, else the text."""
    import json

    if not isinstance(text, str):
        return json.dumps(text, indent=2, ensure_ascii=False, default=str)
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, (dict, list)):
        return json.dumps(value, indent=2, ensure_ascii=False)
    return text


def _brief(text: str, limit: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _tool_call_html(call: dict[str, Any]) -> str:
    """One tool call, folded: ``name(the first arguments)`` and the result's first words on the
    summary line; the arguments and the result as indented JSON inside."""
    import json

    name, arguments = call["function"]["name"], call["function"]["arguments"]
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        shown = ", ".join(f"{k}={_brief(json.dumps(v, ensure_ascii=False), 40)}"
                          for k, v in list(parsed.items())[:2])
        shown += ", …" if len(parsed) > 2 else ""
    else:
        shown = _brief(str(arguments), 60)
    result = (f" &rarr; <span style='{_MUTED}'>{html.escape(_brief(call['result']))}</span>"
              if "result" in call else "")
    pre = ("<pre style='white-space:pre-wrap;margin:2px 0 4px 14px;max-height:300px;"
           "overflow:auto'>")
    label = "<div style='margin-left:14px'>{}</div>"
    body = f"{label.format('arguments')}{pre}{html.escape(_pretty(arguments))}</pre>"
    if "result" in call:
        body += f"{label.format('result')}{pre}{html.escape(_pretty(call['result']))}</pre>"
    return (f"<details style='margin-left:14px'><summary><code>{html.escape(name)}"
            f"({html.escape(shown)})</code>{result}</summary>{body}</details>")


@magics_class
class MetaClawMagics(Magics):
    """State: one running :class:`metaclaw.runtime.Runtime` and the chat histories."""

    def __init__(self, shell: Any):
        super().__init__(shell)
        self.runtime = None
        self.histories: dict[str, list[dict[str, Any]]] = {}
        #: the session id each chat name records its conversation under (see :meth:`_session`)
        self.sessions: dict[str, str] = {}
        self.proposal = None  # the last dry-run evolver proposal, for %metaclaw promote
        self.scheduler = None  # the scheduler %metaclaw scheduler built to show (no training)

    # The dispatcher -------------------------------------------------------------------------
    @line_cell_magic
    def metaclaw(self, line: str, cell: str | None = None) -> Any:
        # A call that fails or is stopped raises IPython's own UsageError (that class, not a
        # subclass): shown as one line, not a traceback, and, being the cell's error, it stops
        # Run All and fails the cell under nbconvert and nbmake instead of letting the next
        # cells run on what it did not do.
        try:
            words = shlex.split(_without_comment(line))
        except ValueError as exc:  # an unclosed quote
            raise UsageError(f"%metaclaw: cannot read the arguments ({exc}); close the "
                             "quote") from None
        if not words:
            return self._help()
        action, rest = words[0], words[1:]
        handler = getattr(self, f"_do_{action.replace('-', '_')}", None)
        if handler is None:
            raise UsageError(f"%metaclaw: unknown action {action!r}. {self._actions()}")
        try:
            return handler(rest, cell)
        except _HelpShown:
            return None
        except MagicUsageError as exc:
            said = str(exc).strip()
        except MagicInterrupted as exc:
            said = f"%metaclaw {action}: {exc}"
        except Exception as exc:  # a clear sentence; the kernel stays alive
            said = f"%metaclaw {action}: {type(exc).__name__}: {exc}"
            if lock_busy(exc):
                said = (f"%metaclaw {action}: another process held the workspace's write lock "
                        f"for over {BUSY_TIMEOUT_S:.0f} s, so nothing was changed; run it again "
                        "once that process is done (a long evolve, a bulk import)")
        raise UsageError(said)

    def _actions(self) -> str:
        names = sorted(n[4:].replace("_", "-") for n in dir(self) if n.startswith("_do_"))
        return "Actions: " + ", ".join(names)

    def _help(self) -> None:
        print(__doc__.strip())
        print(self._actions())

    def _shutdown(self) -> None:
        """Stop the proxy and release what this kernel holds on the workspace: the store's
        connection (its file handles; kept open while a widget still shows the workspace) and
        the scheduler built for %metaclaw scheduler (its notebook callbacks and input
        listeners)."""
        from metaclaw.notebook.widgets import release_store

        runtime, self.runtime = self.runtime, None
        scheduler, self.scheduler = self.scheduler, None
        self.proposal = None  # made from that workspace: never promoted into the next one
        if scheduler is not None:
            scheduler.close()
        if runtime is not None:
            runtime.stop()
            # the widgets still on the page keep reading the workspace: it is closed with the
            # last of them (or now, when none shows it)
            release_store(runtime.store)

    def _require_runtime(self):
        if self.runtime is None:
            raise MagicUsageError("no MetaClaw proxy is running; run %metaclaw start first")
        return self.runtime

    # Actions ---------------------------------------------------------------------------------
    def _do_start(self, argv: list[str], cell: str | None):
        """Start the proxy (same options as `metaclaw serve`; port 0 = any free port)."""
        from metaclaw.runtime import Runtime, RuntimeConfig

        args = _start_parser().parse_args(argv)
        previous = self.runtime.url if self.runtime is not None else None
        if previous and args.port and f":{args.port}/" not in previous:
            _check_port_free(args.host, args.port, previous)  # before the running one stops
        if self.runtime is not None and self.runtime.config.local_model:
            # a model in memory (on a GPU that holds one copy): freed before the next loads
            self._shutdown()
        try:  # a configuration refused here (a skills path that is a file, a model that
            # cannot load) leaves the running proxy as it was
            runtime = Runtime.build(RuntimeConfig.from_args(args))
        except Exception as exc:
            if previous:
                still = "is still running" if self.runtime is not None else "was stopped"
                raise MagicUsageError(f"%metaclaw start: {type(exc).__name__}: {exc} (the "
                                      f"proxy at {previous} {still})") from None
            raise
        self._shutdown()  # the old one entirely, its port and watcher among them
        try:
            self.runtime = runtime.launch()
        except Exception as exc:
            if previous:
                raise MagicUsageError(f"%metaclaw start: {type(exc).__name__}: {exc} (the "
                                      f"proxy at {previous} was stopped)") from None
            raise
        self.histories.clear()
        self.sessions.clear()
        if previous:
            print(f"stopped the proxy at {previous}; the chat sessions start afresh")
        return self.runtime

    def _do_status(self, argv: list[str], cell: str | None):
        """Show the running proxy: URL, upstream, skill generation, counts."""
        _parser("status", self._do_status.__doc__).parse_args(argv)
        return _Status(self._require_runtime())

    def _do_why(self, argv: list[str], cell: str | None):
        """%metaclaw why [--session S] [--last N]: why each turn got its skills (the ask found
        in the request, the skills' scores, how the session was identified), polars."""
        from metaclaw.skills.retrieval import explain_frame

        parser = _parser("why", self._do_why.__doc__)
        parser.add_argument("--session")
        parser.add_argument("--last", type=_count, default=20)
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        runtime.proxy.flush()
        return explain_frame(runtime.store, session=self._named(args.session), last=args.last)

    def _do_events(self, argv: list[str], cell: str | None):
        """%metaclaw events [--kind K] [--last N]: what the loops reported (failed judge and
        evolver calls, broken skill files), newest first, as a polars DataFrame."""
        parser = _parser("events", self._do_events.__doc__)
        parser.add_argument("--kind")
        parser.add_argument("--last", type=_count, default=50)
        args = parser.parse_args(argv)
        store = self._require_runtime().store
        where, params = ("kind = ?", [args.kind]) if args.kind else ("1=1", [])
        return store.frame("events", where, params).sort("id", descending=True).head(args.last)

    def _do_stop(self, argv: list[str], cell: str | None) -> None:
        """Stop the proxy (and the offline double); the widgets shown keep working. With none
        running it says so and the cell succeeds (a clean-up cell may run twice)."""
        _parser("stop", self._do_stop.__doc__).parse_args(argv)
        if self.runtime is None:
            print("no MetaClaw proxy is running: nothing to stop")
            return
        self._shutdown()
        print("MetaClaw proxy stopped.")

    def _do_chat(self, argv: list[str], cell: str | None) -> ChatTurn:
        """%%metaclaw chat [--session S] [--side | --type T] [--new] [--done] [--workspace DIR]
        [--as NAME]: the cell is a user message. With --workspace the model gets file tools
        confined to DIR (read, write, list, copy, append) and the tool calls run until it
        answers. --as NAME also keeps the turn in the notebook variable NAME (``_`` is only the
        last cell's value, and no longer this turn once another cell has run). A new
        conversation under a session name the workspace already has turns of records as
        NAME.2, NAME.3, ... (after a restart, a new start, or --new)."""
        parser = _parser("chat", self._do_chat.__doc__)
        parser.add_argument("--session", default="notebook")
        parser.add_argument("--side", action="store_true", help="a side turn (no skills)")
        parser.add_argument("--type", help="the turn type to send: main, side or stage:<name> "
                                           "(a pipeline stage: its own and general skills)")
        parser.add_argument("--new", action="store_true", help="forget this session's history")
        parser.add_argument("--done", action="store_true", help="mark the session done")
        parser.add_argument("--workspace", help="offer file tools confined to this folder")
        parser.add_argument("--max-steps", type=_positive, default=12, help="tool-loop limit")
        parser.add_argument("--max-tokens", type=_positive, help="limit the reply's length")
        parser.add_argument("--as", dest="name", metavar="NAME",
                            help="also keep the turn in the notebook variable NAME")
        if cell is None:  # `%metaclaw chat hello` as a line
            raise MagicUsageError("chat is a cell magic: put %%metaclaw chat on the cell's first "
                                  "line and the message below it")
        args = parser.parse_args(argv)
        if args.name is not None and not (args.name.isidentifier()
                                          and not keyword.iskeyword(args.name)):
            raise MagicUsageError(f"chat --as: {args.name!r} is not a Python variable name")
        if not cell or not cell.strip():
            raise MagicUsageError("%%metaclaw chat needs the message in the cell body")
        if args.done and args.workspace:
            raise MagicUsageError("end a session with a message of its own: %%metaclaw chat "
                                  "--done without --workspace (e.g. the user's final feedback)")
        if args.side and args.type:
            raise MagicUsageError("give --side or --type, not both (--side is --type side)")
        turn_type = args.type or ("side" if args.side else "main")
        try:  # a one-line usage error here rather than the proxy's 400 as a traceback
            from metaclaw.turns import check_session_id, check_turn_type

            turn_type = check_turn_type(turn_type, "--type")
            session = check_session_id(args.session, "--session")
        except ValueError as exc:
            raise MagicUsageError(str(exc)) from None
        runtime = self._require_runtime()
        workspace = tools = None
        if args.workspace:
            from metaclaw.bench.workspace import TOOL_SCHEMAS, Workspace

            workspace, tools = Workspace(args.workspace), TOOL_SCHEMAS
        history = self.histories.setdefault(session, [])
        if args.new:
            history.clear()
        name, session = session, self._session(session, runtime.store, new=not history)
        start = len(history)
        if workspace is not None and not history:
            from metaclaw.bench.agent import system_prompt

            history.append({"role": "system", "content": system_prompt(workspace)})
        history.append({"role": "user", "content": cell.strip()})
        runtime.proxy.flush()  # earlier turns are in the store, so only this exchange's are new
        before = runtime.store.query("SELECT COALESCE(MAX(id), 0) AS id FROM turns")[0]["id"]
        # the proxy's fields go in the body, not in headers: a session named in any language
        # (a header carries ASCII only)
        fields: dict[str, Any] = {"session_id": session, "turn_type": turn_type}
        # no client retries: the proxy already retries the upstream, and every attempt the client
        # made would be recorded as one more turn of this one message
        client = runtime.client(max_retries=0)
        runtime.proxy.show_failures_elsewhere(session)  # this cell says why a turn failed
        calls: list[dict[str, Any]] = []
        try:
            if args.done:
                fields["session_done"] = True
            for _ in range(args.max_steps):
                completion = client.chat.completions.create(
                    model=runtime.config.model or "default", messages=history,
                    extra_body=fields, **({"tools": tools} if tools else {}),
                    **({"max_tokens": args.max_tokens} if args.max_tokens else {}))
                message = completion.choices[0].message
                from metaclaw.bench.workspace import tool_step

                added, made = tool_step(workspace, message)
                history += added
                calls += made
                if not made or workspace is None:
                    break
            else:
                raise MagicUsageError(f"the model was still calling tools after {args.max_steps} "
                                      f"steps; raise --max-steps")
        except KeyboardInterrupt:
            del history[start:]  # a failed exchange leaves the conversation as it was
            raise MagicInterrupted(
                "interrupted: the message was not added to this session's history; what the "
                "proxy had served is recorded (%metaclaw turns)") from None
        except BaseException as exc:
            del history[start:]
            status = getattr(exc, "status_code", None)  # the proxy's answer: what it says
            if isinstance(status, int) and isinstance(getattr(exc, "body", None), dict):
                reason = exc.body.get("message") or exc.body.get("error") or exc.body
                raise MagicUsageError(f"%metaclaw chat: the proxy answered HTTP {status}: "
                                      f"{reason}; the message was not added to this "
                                      "session's history") from None
            raise
        runtime.proxy.flush()  # turns are recorded off the request path; wait for these
        rows = runtime.store.turns("session_id = ? AND id > ?", (session, before))
        turn = ChatTurn(session, cell.strip(), message.content or "", calls, rows)
        self.sessions[name] = session
        if args.name is not None and self.shell is not None:
            self.shell.user_ns[args.name] = turn
        return turn

    def _session(self, name: str, store: Any, *, new: bool) -> str:
        """The session id a chat named ``name`` records under: the one its conversation began
        with; for a new conversation (the first message after a start, a kernel restart or
        ``--new``), ``name`` itself where the workspace holds no turn of it yet, else ``name.2``,
        ``name.3``, ... so that the judge never reads a message of a new conversation as the
        reaction to an old one (the proxy numbers a restarted conversation the same way). The
        id is claimed in the workspace before the first message goes
        (:meth:`~metaclaw.store.Store.claim_session`): another kernel on the same workspace,
        starting a conversation of the same name before this one's first turn is recorded,
        takes the next number."""
        if not new and name in self.sessions:
            return self.sessions[name]
        taken = set(self.sessions.values())
        for n in itertools.count(1):
            candidate = name if n == 1 else f"{name}.{n}"
            if candidate in taken or store.query(
                    "SELECT 1 AS x FROM turns WHERE session_id = ? LIMIT 1", (candidate,)):
                continue
            for _ in range(100):  # a claim never waits for the write lock: try again a while
                claimed = store.claim_session(candidate)
                if claimed is not None:
                    break
                time.sleep(0.02)
            if claimed is not False:  # (still busy after two seconds: numbered as recorded)
                return candidate
        raise AssertionError("unreachable")

    def _named(self, session: str | None) -> str | None:
        """A ``--session`` given to a reading action: a chat's name means the session its
        conversation records under (see :meth:`_session`); ``=ID`` the stored session ``ID``
        as it is (an earlier conversation under that name, after a restart)."""
        if not session:
            return session
        if session.startswith("=") and session not in self.sessions:  # (a chat named "=x")
            return session[1:]
        mapped = self.sessions.get(session, session)
        if mapped != session:
            print(f"(this kernel's conversation {session!r} records as {mapped!r}; "
                  f"--session ={session} names the stored session {session!r})")
        return mapped

    def _do_skills(self, argv: list[str], cell: str | None):
        """%metaclaw skills [--generation G]: the skill library as a table."""
        parser = _parser("skills", self._do_skills.__doc__)
        parser.add_argument("--generation", type=int)
        args = parser.parse_args(argv)
        return self._require_runtime().library.frame(args.generation)

    def _do_keys(self, argv: list[str], cell: str | None):
        """%metaclaw keys [NAME ...] [--rewrite]: the evolver model writes the "use when" line
        and anticipated asks of the skills that have none (--rewrite: again), as one generation."""
        parser = _parser("keys", self._do_keys.__doc__)
        parser.add_argument("names", nargs="*")
        parser.add_argument("--rewrite", action="store_true")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        return self._library_change(runtime, lambda: runtime.write_keys(
            args.names or None, rewrite=args.rewrite, on_progress=_cell_progress()))

    def _do_diff(self, argv: list[str], cell: str | None):
        """%metaclaw diff [G1 G2] [--follow]: the SkillDiffWidget (default: previous vs current
        generation), pinned to those generations; --follow moves it to each new generation."""
        from metaclaw.notebook.widgets import SkillDiffWidget

        parser = _parser("diff", self._do_diff.__doc__)
        parser.add_argument("generations", nargs="*", type=int)
        parser.add_argument("--follow", action="store_true",
                            help="show each new generation as it is written")
        args = parser.parse_args(argv)
        if len(args.generations) not in (0, 2):
            raise MagicUsageError("%metaclaw diff takes no generation or two: %metaclaw diff 1 3")
        library = self._require_runtime().library
        import traitlets

        try:
            return SkillDiffWidget(library, *args.generations, follow=args.follow)
        except traitlets.TraitError as exc:  # a generation that does not exist: its sentence
            raise MagicUsageError(f"%metaclaw diff: {exc}") from None

    def _do_experiment(self, argv: list[str], cell: str | None):
        """%metaclaw experiment [NAME] [--variant V] [--follow]: an experiment's view (default:
        the latest; `metaclaw experiment run` or metaclaw.fastloop.experiments make them)."""
        from metaclaw.fastloop.experiments import ExperimentError
        from metaclaw.notebook.experiment_view import show_experiment

        parser = _parser("experiment", self._do_experiment.__doc__)
        parser.add_argument("name", nargs="?")
        parser.add_argument("--variant", help="the variant compared with the first")
        parser.add_argument("--follow", action="store_true",
                            help="show results as they are stored")
        args = parser.parse_args(argv)
        try:
            return show_experiment(args.name, store=self._require_runtime().store,
                                   variant=args.variant, follow=args.follow)
        except ExperimentError as exc:
            raise MagicUsageError(f"%metaclaw experiment: {exc}") from None

    def _do_evidence(self, argv: list[str], cell: str | None):
        """%metaclaw evidence [--all-versions]: per-skill evidence of the library
        (metaclaw.fastloop.evidence), each skill's current version unless --all-versions, with its
        suggestions; its button files them as proposals held for review."""
        from metaclaw.notebook.experiment_view import evidence_view

        parser = _parser("evidence", self._do_evidence.__doc__)
        parser.add_argument("--all-versions", action="store_true",
                            help="count every version of a skill since it was last added")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        runtime.proxy.flush()
        return evidence_view(runtime.store, runtime.library, all_versions=args.all_versions)

    def _do_buffers(self, argv: list[str], cell: str | None):
        """%metaclaw buffers: the support / query buffers (BufferWidget; .frame is polars)."""
        from metaclaw.notebook.widgets import BufferWidget

        _parser("buffers", self._do_buffers.__doc__).parse_args(argv)
        return BufferWidget(self._require_runtime().store)

    def _do_score(self, argv: list[str], cell: str | None):
        """%metaclaw score [--session S] [--last N] [--rescore]: judge turns with the PRM judge;
        returns a polars DataFrame of verdicts (score, votes, failed/unparsable counts)."""
        import polars as pl

        from metaclaw.fastloop.judge import turns_to_score
        from metaclaw.fastloop.llm import record_call_failure

        parser = _parser("score", self._do_score.__doc__)
        parser.add_argument("--session")
        parser.add_argument("--last", type=_count)
        parser.add_argument("--rescore", action="store_true")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        judge = runtime.judge  # a clear error now when no judge model is configured
        runtime.proxy.flush()
        session = self._named(args.session)
        ids = turns_to_score(runtime.store, session=session, last=args.last,
                             rescore=args.rescore)
        if not ids and not _said_unknown(runtime.store, session):  # an empty table says why
            print("(no turn left to judge" + ("" if args.rescore else
                                              "; --rescore judges them again") + ")")
        try:
            results = judge.judge_turns(runtime.store, ids, rescore=args.rescore,
                                        on_progress=_cell_progress()) if ids else []
        except KeyboardInterrupt:
            raise MagicInterrupted(
                "interrupted: the judge calls still running were cancelled and their turns "
                "left free to judge again (%metaclaw score); verdicts already stored stay"
            ) from None
        for r in results:  # counted where the fast loop's and the CLI's failures are
            if r.failed_call:
                record_call_failure(runtime.store, "judge_failed", judge,
                                    r.error or r.rationale or "no usable vote", source="notebook",
                                    turn_id=r.turn_id)
        return pl.DataFrame([{
            "turn_id": r.turn_id, "score": r.score, "votes": len(r.votes), "failed": r.failed,
            "unparsable": r.unparsable, "rationale": r.rationale or r.error or "",
            "judge_model": r.model} for r in results],
            schema={"turn_id": pl.Int64, "score": pl.Int64, "votes": pl.Int64,
                    "failed": pl.Int64, "unparsable": pl.Int64, "rationale": pl.String,
                    "judge_model": pl.String})

    def _do_evolve(self, argv: list[str], cell: str | None):
        """%metaclaw evolve [--dry-run]: distill the support set into skill operations
        (--dry-run keeps the proposal for %metaclaw promote)."""
        from metaclaw.fastloop.evolver import EvolveError
        from metaclaw.fastloop.llm import record_call_failure

        parser = _parser("evolve", self._do_evolve.__doc__)
        parser.add_argument("--dry-run", action="store_true")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        runtime.proxy.flush()
        evolver = runtime.evolver
        try:
            result = self._library_change(runtime, lambda: evolver.evolve(
                dry_run=args.dry_run, on_progress=_cell_progress()))
        except EvolveError as exc:
            if exc.kind == "failed":  # the call failed or its answer was not usable: recorded
                record_call_failure(runtime.store, "evolve_failed", evolver, str(exc),
                                    source="notebook")
            raise MagicUsageError(f"%metaclaw evolve: library unchanged: {exc}") from None
        self.proposal = result.proposal if args.dry_run else None
        return result

    @staticmethod
    def _library_change(runtime: Any, change: Any) -> Any:
        """``change()`` (an evolve or an apply); when the user stops it, say whether the library
        changed before the cancellation reached it."""
        before = runtime.library.generation
        try:
            return change()
        except KeyboardInterrupt:
            now = runtime.library.sync()
            if now != before:
                raise MagicInterrupted(
                    f"interrupted, but the library had already changed: it is now generation "
                    f"{now} (was {before}); see %metaclaw diff") from None
            raise MagicInterrupted(f"interrupted: the evolver was cancelled and the library is "
                                   f"unchanged (generation {before})") from None

    def _do_promote(self, argv: list[str], cell: str | None):
        """%metaclaw promote [ID] [--by NAME] [--note TEXT] [--allow-unsafe]: promote held
        proposal ID (see %metaclaw proposals); without ID, apply the proposal of the last
        %metaclaw evolve --dry-run."""
        from metaclaw.fastloop import proposals

        parser = _parser("promote", self._do_promote.__doc__)
        parser.add_argument("id", nargs="?", type=int)
        parser.add_argument("--by")
        parser.add_argument("--note", default="")
        parser.add_argument("--allow-unsafe", action="store_true")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        if args.id is not None:
            proposals.promote(runtime.store, runtime.library, args.id, by=args.by,
                              note=args.note, allow_unsafe=args.allow_unsafe,
                              threshold=self._threshold(runtime))
            return proposals.get(runtime.store, args.id)
        if self.proposal is None:
            raise MagicUsageError("nothing to promote: give a held proposal's id (%metaclaw "
                                  "proposals) or run %metaclaw evolve --dry-run first")
        proposal = self.proposal
        result = self._library_change(runtime, lambda: runtime.evolver.apply(proposal))
        self.proposal = None
        return result

    def _do_proposals(self, argv: list[str], cell: str | None):
        """%metaclaw proposals [--all]: held skill proposals with their gate evidence, beside
        the skill diff (SkillDiffWidget: review, edit, promote or discard); --all gives every
        proposal as a polars DataFrame."""
        from metaclaw.fastloop import proposals
        from metaclaw.notebook.widgets import SkillDiffWidget

        parser = _parser("proposals", self._do_proposals.__doc__)
        parser.add_argument("--all", action="store_true")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        if args.all:
            return proposals.frame(runtime.store)
        # pinned to the current generation: the review of the proposals, not the last change
        # (which read as proposals pending); %metaclaw diff shows the changes
        generation = runtime.library.generation
        return SkillDiffWidget(runtime.library, generation, generation)

    def _do_edit_proposal(self, argv: list[str], cell: str | None):
        """%%metaclaw edit-proposal ID SKILL [--by NAME]: the cell is the skill's new body."""
        from metaclaw.fastloop import proposals

        parser = _parser("edit-proposal", self._do_edit_proposal.__doc__)
        parser.add_argument("id", type=int)
        parser.add_argument("skill")
        parser.add_argument("--by")
        args = parser.parse_args(argv)
        if not cell or not cell.strip():
            raise MagicUsageError("%%metaclaw edit-proposal needs the skill's new body in the "
                                  "cell")
        return proposals.edit(self._require_runtime().store, args.id, args.skill,
                              body=cell.strip(), by=args.by)

    def _do_discard(self, argv: list[str], cell: str | None):
        """%metaclaw discard ID [--by NAME] [--reason TEXT]: discard a held proposal."""
        from metaclaw.fastloop import proposals

        parser = _parser("discard", self._do_discard.__doc__)
        parser.add_argument("id", type=int)
        parser.add_argument("--by")
        parser.add_argument("--reason", default="")
        args = parser.parse_args(argv)
        return proposals.discard(self._require_runtime().store, args.id, by=args.by,
                                 reason=args.reason)

    def _do_revert(self, argv: list[str], cell: str | None):
        """%metaclaw revert [G] [--by NAME]: undo generation G's changes (default: the latest
        automatic generation) as a new generation."""
        from metaclaw.fastloop import proposals

        parser = _parser("revert", self._do_revert.__doc__)
        parser.add_argument("generation", nargs="?", type=int)
        parser.add_argument("--by")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        try:
            new = proposals.revert(runtime.library, args.generation, by=args.by)
        except proposals.ProposalError as exc:
            raise MagicUsageError(f"%metaclaw revert: {exc}") from None
        print(f"reverted ({runtime.store.generation(new)['reason']}): the library is now "
              f"generation {new}")
        return runtime.library

    def _do_trace(self, argv: list[str], cell: str | None):
        """%metaclaw trace [SESSION] [--failures]: the TraceWidget for a session (default: the
        most recent; with --failures, the most recent with a failure): turns as the upstream saw
        them, judge votes, labels; .trace.index() is polars."""
        from metaclaw.notebook.widgets import TraceWidget

        parser = _parser("trace", self._do_trace.__doc__)
        parser.add_argument("session", nargs="?")
        parser.add_argument("--failures", action="store_true", help="only failed turns")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        runtime.proxy.flush()
        session = self._named(args.session)
        if session is None and args.failures:  # the newest session that has a failure
            from metaclaw.buffers import FAILURE_SQL

            found = runtime.store.query(f"SELECT session_id FROM turns WHERE {FAILURE_SQL} "
                                        "ORDER BY id DESC LIMIT 1", (self._threshold(runtime),))
            session = found[0]["session_id"] if found else None
        return TraceWidget(runtime.store, session, failures_only=args.failures,
                           threshold=self._threshold(runtime))

    @staticmethod
    def _threshold(runtime: Any) -> float:
        judge = runtime.extras.get("judge")
        return float(judge.threshold) if judge is not None else 0.0

    def _do_label(self, argv: list[str], cell: str | None):
        """%metaclaw label TURN pass|fail [--note TEXT] [--by NAME]; as a cell magic the cell
        is the corrected answer. The human label takes precedence over the judge."""
        from metaclaw.fastloop import labels

        parser = _parser("label", self._do_label.__doc__)
        parser.add_argument("turn", type=int)
        parser.add_argument("verdict", choices=["pass", "fail"])
        parser.add_argument("--note", default="")
        parser.add_argument("--by")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        runtime.proxy.flush()
        row = labels.label(runtime.store, args.turn, args.verdict, note=args.note,
                           corrected=cell.strip() if cell and cell.strip() else None,
                           author=args.by)
        print(f"turn #{row['turn_id']} labelled {row['verdict']} by {row['author']}"
              + labels.reach(row))
        return None

    def _do_labels(self, argv: list[str], cell: str | None):
        """%metaclaw labels [--session S]: labelled turns beside the judge's verdict (polars)."""
        from metaclaw.fastloop import labels

        parser = _parser("labels", self._do_labels.__doc__)
        parser.add_argument("--session")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        return labels.frame(runtime.store, session=self._named(args.session),
                            threshold=self._threshold(runtime))

    def _do_agreement(self, argv: list[str], cell: str | None):
        """%metaclaw agreement: judge-human agreement per session and overall (table + chart;
        .table is polars, .chart() altair)."""
        from metaclaw.fastloop import labels

        _parser("agreement", self._do_agreement.__doc__).parse_args(argv)
        runtime = self._require_runtime()
        return labels.agreement(runtime.store, threshold=self._threshold(runtime))

    def _do_export(self, argv: list[str], cell: str | None):
        """%metaclaw export PATH [--session S] [--turns 1,2,3] [--labelled] [--shape chat|eval]:
        turns with their labels as JSONL (.jsonl: OpenAI fine-tuning "chat" or "eval" shape) or
        Parquet (.parquet)."""
        from metaclaw.fastloop import labels

        parser = _parser("export", self._do_export.__doc__)
        parser.add_argument("path")
        parser.add_argument("--session")
        parser.add_argument("--turns", help="comma-separated turn ids")
        parser.add_argument("--labelled", "--labelled-only", action="store_true",
                            dest="labelled", help="only labelled turns")
        parser.add_argument("--shape", choices=["chat", "eval"], default="chat")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        runtime.proxy.flush()
        try:
            turn_ids = ([int(t) for t in args.turns.split(",") if t.strip()]
                        if args.turns else None)
        except ValueError:
            raise MagicUsageError("--turns takes turn ids separated by commas: --turns 3,4,9")
        selection = {"turn_ids": turn_ids, "session": self._named(args.session),
                     "labelled_only": args.labelled, "threshold": self._threshold(runtime)}
        try:
            n = labels.export_file(runtime.store, args.path, shape=args.shape, **selection)
        except ValueError as exc:
            raise MagicUsageError(str(exc)) from None
        print(labels.export_summary(n, args.path, shape=args.shape, labelled_only=args.labelled))
        _said_unknown(runtime.store, selection["session"], turn_ids or ())
        return None

    def _do_train(self, argv: list[str], cell: str | None):
        """%metaclaw train --base-model PATH [--backend local|tinker] [--now] [--steps N]: GRPO on
        the query set in the background, in idle windows (sleep, keyboard, notebook idle) unless
        --now; the proxy serves the trained policy, hot-swapped. Returns a live TrainingMonitor;
        the cell returns at once."""
        from metaclaw.notebook.widgets import TrainingMonitor
        from metaclaw.slowloop.backends import make_backend
        from metaclaw.slowloop.grpo import GRPOConfig
        from metaclaw.slowloop import TRAIN_DEFAULTS
        from metaclaw.slowloop.loop import SlowLoop

        parser = _parser("train", self._do_train.__doc__)
        parser.add_argument("--backend", choices=["local", "tinker"], default="local")
        parser.add_argument("--base-model", help="local model path or Tinker model id "
                            "(needed the first time)")
        parser.add_argument("--now", action="store_true", help="train now, ignore idle signals")
        parser.add_argument("--steps", type=argtypes.positive_int, default=TRAIN_DEFAULTS["steps"])
        parser.add_argument("--group-size", type=argtypes.group_size,
                            default=TRAIN_DEFAULTS["group_size"])
        parser.add_argument("--groups-per-step", type=argtypes.positive_int,
                            default=TRAIN_DEFAULTS["groups_per_step"])
        parser.add_argument("--max-tokens", type=argtypes.positive_int,
                            default=TRAIN_DEFAULTS["max_tokens"])
        parser.add_argument("--lr", type=argtypes.positive_float,
                            default=TRAIN_DEFAULTS["learning_rate"])
        parser.add_argument("--no-serve", action="store_true",
                            help="keep answering from the upstream, only train")
        parser.add_argument("--scheduler-config", help="scheduler settings file (YAML/JSON)")
        parser.add_argument("--state-dir", help="where training states are saved (default: "
                            "train/ beside the workspace); another base model than the one "
                            "saved there needs a folder of its own")
        parser.add_argument("--reward", metavar="NAME", help="a callable (prompt, completion_text)"
                            " -> float in the notebook's namespace (default: the PRM judge)")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        reward = None
        if args.reward:
            reward = (self.shell.user_ns if self.shell is not None else {}).get(args.reward)
            if not callable(reward):
                raise MagicUsageError(f"--reward {args.reward}: no callable of that name in the "
                                      f"notebook; define def {args.reward}(prompt, text) -> float")
        if args.now:  # said before the model loads, as `metaclaw train --now` does
            from metaclaw.slowloop.loop import nothing_to_train

            empty = nothing_to_train(runtime.store)
            if empty:
                raise MagicUsageError(f"%metaclaw train --now: {empty} (%%metaclaw chat)")
        loop = runtime.extras.get("slow_loop")
        if loop is None:
            if not args.base_model:
                raise MagicUsageError("the first %metaclaw train needs --base-model (a local "
                                      "model path, e.g. from `metaclaw tiny-model DIR`)")
            config = GRPOConfig(steps=args.steps, group_size=args.group_size,
                                groups_per_step=args.groups_per_step,
                                max_tokens=args.max_tokens, learning_rate=args.lr)
            scheduler_config = _notebook_scheduler_config(args.scheduler_config)
            try:
                judge = reward or runtime.judge
            except ValueError as exc:  # no judge model: a reward function does instead
                raise MagicUsageError(f"{exc}; or pass --reward NAME, a function (prompt, "
                                      "text) -> float defined in the notebook") from None
            loop = SlowLoop(runtime.store, make_backend(args.backend, args.base_model),
                            config=config, judge=judge, proxy=runtime.proxy,
                            serve=not args.no_serve, scheduler_config=scheduler_config,
                            state_dir=args.state_dir
                            or str(local_dir(runtime.store.target) / "train"))
            runtime.extras["slow_loop"] = loop
        else:
            kept = [f"--{name.replace('_', '-')}" for name in (
                "backend", "base_model", "group_size", "groups_per_step", "max_tokens", "lr",
                "no_serve", "scheduler_config", "reward", "state_dir")
                if getattr(args, name) != parser.get_default(name)]
            if kept:
                print(f"%metaclaw train: this session's slow loop keeps its model and settings, "
                      f"so {', '.join(kept)} did nothing (only --steps and --now apply); "
                      "%metaclaw stop, then %metaclaw start, to train with others")
            if loop.scheduler is not None:
                loop.stop()
        self._attach_notebook_signal(loop.start(now=args.now, steps=args.steps))
        return TrainingMonitor(runtime.store)

    def _do_scheduler(self, argv: list[str], cell: str | None):
        """%metaclaw scheduler: the training scheduler's state, signals and timeline."""
        from metaclaw.notebook.widgets import SchedulerView
        from metaclaw.slowloop.scheduler.machine import from_config

        _parser("scheduler", self._do_scheduler.__doc__).parse_args(argv)
        runtime = self._require_runtime()
        loop = runtime.extras.get("slow_loop")
        if loop is not None and loop.scheduler is not None:
            return SchedulerView(loop.scheduler, runtime.store)
        if self.scheduler is None:  # one per proxy: each holds notebook callbacks (and, with a
            # display, keyboard and mouse listeners) until closed by %metaclaw stop or start
            self.scheduler = from_config(_notebook_scheduler_config(None), store=runtime.store)
            self._attach_notebook_signal(self.scheduler)
        return SchedulerView(self.scheduler, runtime.store)

    def _attach_notebook_signal(self, scheduler: Any) -> None:
        """Notebook idleness comes from this kernel's cell executions."""
        for signal in scheduler.signals:
            if callable(getattr(signal, "attach", None)) and self.shell is not None:
                signal.attach(self.shell)

    def _do_runtime(self, argv: list[str], cell: str | None):
        """%metaclaw runtime: the running Runtime (store, library, proxy, client())."""
        return self._require_runtime()

    def _do_turns(self, argv: list[str], cell: str | None):
        """%metaclaw turns [--session S] [--type T]: recorded turns as a polars DataFrame (``--type
        stage:plan``: one stage's turns; ``--type stage``: every stage turn). The ask's recorded
        retrieval features, an encoded vector for per-skill evidence, are left out
        (``runtime.store.frame("turns")`` has every column)."""
        from metaclaw.turns import turns_filter

        parser = _parser("turns", self._do_turns.__doc__)
        parser.add_argument("--session")
        parser.add_argument("--type", help="main, side, stage:<name>, or stage (every stage)")
        args = parser.parse_args(argv)
        runtime = self._require_runtime()
        runtime.proxy.flush()
        try:
            where, params = turns_filter(self._named(args.session), args.type)
        except ValueError as exc:
            raise MagicUsageError(str(exc)) from None
        return runtime.store.frame("turns", where, params).drop("ask_features", strict=False)


def _cell_progress() -> Any:
    """An ``on_progress`` (metaclaw.progress) drawing a bar in the running cell's output; None
    where ipywidgets is missing."""
    import time

    try:
        import ipywidgets
        from IPython.display import display
    except ImportError:
        return None
    bar = ipywidgets.IntProgress(value=0, min=0, max=1, layout={"width": "320px"})
    label = ipywidgets.Label("")

    class ProgressBox(ipywidgets.HBox):
        def __repr__(self) -> str:  # a frontend without widgets (nbconvert, GitHub) shows it
            return label.value or "starting"

    box = ProgressBox([bar, label])
    shown: list[Any] = []  # the display's handle
    updated = [0.0]

    def on_progress(event: Any) -> None:
        bar.max = max(1, event.total or event.done or 1)
        bar.value = min(event.done, bar.max)
        label.value = str(event)
        if not shown:
            shown.append(display(box, display_id=True))
            updated[0] = time.monotonic()
            return
        # the saved text (nbconvert, CI logs) says where the work stands: at its end, and every
        # second or so before, so that a call that fails or is stopped does not leave "starting"
        now = time.monotonic()
        if shown[0] is not None and (event.total and event.done >= event.total
                                     or now - updated[0] >= 1.0):
            shown[0].update(box)
            updated[0] = now

    return on_progress


def _notebook_scheduler_config(path: str | None) -> dict[str, Any]:
    """The scheduler settings (file or defaults) plus the notebook-idle signal (10 minutes)."""
    from metaclaw.slowloop.scheduler.machine import load_config

    config = load_config(path)
    config.setdefault("signals", {}).setdefault("notebook", {"threshold_s": 600})
    return config


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(MetaClawMagics)
    try:  # altair charts drawn locally as PNG: no CDN, shown before the notebook is trusted
        from metaclaw.notebook import charts

        charts.enable()
    except ImportError:  # altair or vl-convert is not installed: nothing to set up
        pass


def unload_ipython_extension(ipython: Any) -> None:
    magics = ipython.magics_manager.registry.get("MetaClawMagics")
    if magics is not None:
        magics._shutdown()
