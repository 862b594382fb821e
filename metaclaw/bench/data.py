"""Load a MetaClaw-Bench data folder (the small 12-day subset or the full 30-day benchmark).

A data folder holds ``all_tests.json`` (the days), ``eval/<day>/questions.json`` (the rounds),
``workspaces/shared/`` (context files and one input folder per day) and, optionally,
``openclaw_state/`` (the seed conversation of each day). Paths inside ``all_tests.json`` use the
upstream layout ``./benchmark/data/<name>/...``; they are resolved relative to the data folder.

    bench = load_benchmark("metaclaw-bench-small")
    days = select_days(bench, "day01,day03")     # or "all"
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

ROUND_TYPES = ("file_check", "multi_choice")


def small_bench_dir() -> Path:
    """The MetaClaw-Bench small subset shipped with the package (12 days, 61 rounds, MIT)."""
    return Path(__file__).resolve().parent / "data" / "metaclaw-bench-small"


class BenchDataError(ValueError):
    """The data folder is missing a file or a file has the wrong shape (message says which)."""


@dataclass(frozen=True)
class Round:
    """One round of a day: a ``file_check`` (command + expected exit) or a ``multi_choice``."""

    id: str
    type: str
    question: str
    eval: dict
    feedback: dict = field(default_factory=dict)
    update: list = field(default_factory=list)

    @property
    def options(self) -> dict[str, str]:
        """Multiple choice: option letter -> text (empty for file checks)."""
        return dict(self.eval.get("options", {}))

    @property
    def answer(self) -> list[str]:
        """Multiple choice: the correct letters (empty for file checks)."""
        raw = self.eval.get("answer", [])
        return [str(a).strip().upper() for a in (raw if isinstance(raw, list) else list(str(raw)))
                if str(a).strip()]


@dataclass(frozen=True)
class Day:
    """One simulated workday: its rounds, where its files are, and its seed conversation."""

    id: str
    desc: str
    rounds: tuple[Round, ...]
    workspace_src: Path                     # the shared workspace folder (context files + day dirs)
    arc: str = ""
    preference_tags: tuple[str, ...] = ()
    seed_messages: tuple[dict, ...] = ()    # [{"role": "user"|"assistant", "content": str}]

    @property
    def file_check_rounds(self) -> int:
        return sum(r.type == "file_check" for r in self.rounds)

    @property
    def multi_choice_rounds(self) -> int:
        return sum(r.type == "multi_choice" for r in self.rounds)


@dataclass(frozen=True)
class Benchmark:
    """A loaded benchmark: name, data folder and days in file order."""

    name: str
    root: Path
    eval_dir: Path
    workspace_src: Path
    days: tuple[Day, ...]

    @property
    def rounds(self) -> int:
        return sum(len(d.rounds) for d in self.days)

    def day(self, day_id: str) -> Day:
        for d in self.days:
            if d.id == day_id:
                return d
        raise KeyError(f"no day {day_id!r} in {self.name}; days are {', '.join(d.id for d in self.days)}")


def resolve_data_path(root: Path, raw: str | None, default: str) -> Path:
    """Resolve a path from ``all_tests.json`` against the data folder ``root``.

    ``./benchmark/data/<name>/eval`` -> ``root/eval``; other relative paths -> ``root/<path>``;
    absolute paths stay. ``default`` (relative to root) is used when ``raw`` is empty or the
    resolved path does not exist.
    """
    candidates: list[Path] = []
    if raw:
        raw = raw.replace("${METACLAW_ROOT}/", "./")
        p = PurePosixPath(raw)
        parts = [x for x in p.parts if x != "."]
        if p.is_absolute():
            candidates.append(Path(raw))
        elif len(parts) >= 3 and parts[0] == "benchmark" and parts[1] == "data":
            candidates.append(root.joinpath(*parts[3:]))
        else:
            candidates.append(root.joinpath(*parts))
    candidates.append(root / default)
    for c in candidates:
        if c.exists():
            return c
    return candidates[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchDataError(f"{path} does not exist; point --data at a MetaClaw-Bench folder "
                             "(the one holding all_tests.json)") from None
    except json.JSONDecodeError as exc:
        raise BenchDataError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise BenchDataError(f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:  # a folder where the file should be, a file it may not read
        raise BenchDataError(f"{path} cannot be read: {exc.strerror or exc}") from None


def _parse_round(raw: Any, where: str) -> Round:
    if not isinstance(raw, dict):
        raise BenchDataError(f"{where}: a round must be an object")
    rid = raw.get("id")
    rtype = raw.get("type")
    ev = raw.get("eval")
    if not rid or rtype not in ROUND_TYPES or not isinstance(ev, dict):
        raise BenchDataError(f"{where}: round {rid!r} needs an id, a type in {ROUND_TYPES} and an eval object")
    if rtype == "file_check" and not isinstance(ev.get("command"), str):
        raise BenchDataError(f"{where}: file_check round {rid} needs eval.command")
    if rtype == "multi_choice" and (not isinstance(ev.get("options"), dict) or not ev.get("answer")):
        raise BenchDataError(f"{where}: multi_choice round {rid} needs eval.options and eval.answer")
    # checked here: a bad value would otherwise stop the day in the middle of the run
    feedback, update = raw.get("feedback") or {}, raw.get("update") or []
    if not isinstance(feedback, dict):
        raise BenchDataError(f"{where}: round {rid}: feedback must be an object")
    if not isinstance(update, list):
        raise BenchDataError(f"{where}: round {rid}: update must be a list")
    return Round(id=str(rid), type=rtype, question=str(raw.get("question", "")), eval=ev,
                 feedback=feedback, update=update)


def _seed_messages(path: Path) -> tuple[dict, ...]:
    """User/assistant text messages of an OpenClaw session transcript (JSONL); () if absent."""
    if not path.is_file():
        return ()
    out = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BenchDataError(f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(item, dict):  # like an unreadable line: not a transcript entry
            continue
        msg = item.get("message") if item.get("type") == "message" else None
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            continue
        content = msg.get("content")
        if isinstance(content, list):
            content = "\n".join(c["text"] for c in content if isinstance(c, dict)
                                and c.get("type") == "text" and isinstance(c.get("text"), str))
        if isinstance(content, str) and content.strip():
            out.append({"role": msg["role"], "content": content})
    return tuple(out)


def load_benchmark(data_dir: str | Path) -> Benchmark:
    """Load ``all_tests.json`` and every day's ``questions.json`` from ``data_dir``.

    Raises :class:`BenchDataError` with one sentence naming the missing or malformed file.
    """
    root = Path(data_dir).expanduser().resolve()
    if not root.is_dir():
        raise BenchDataError(f"{data_dir} is not a folder; point --data at a MetaClaw-Bench folder")
    tests = _read_json(root / "all_tests.json")
    if not isinstance(tests, dict) or not isinstance(tests.get("test"), list):
        raise BenchDataError(f"{root / 'all_tests.json'} needs a \"test\" list of days")
    eval_dir = resolve_data_path(root, tests.get("eval_dir"), "eval")
    workspace_src = resolve_data_path(root, tests.get("workspace_src"), "workspaces/shared")
    state_dir = resolve_data_path(root, tests.get("openclaw_state_dir"), "openclaw_state")
    if not workspace_src.is_dir():
        raise BenchDataError(f"workspace folder {workspace_src} does not exist")
    days = []
    for entry in tests["test"]:
        if not isinstance(entry, dict) or not entry.get("id"):
            raise BenchDataError(f"{root / 'all_tests.json'}: every test needs an id")
        day_id = str(entry["id"])
        qpath = eval_dir / str(entry.get("eval", day_id)) / "questions.json"
        q = _read_json(qpath)
        if not isinstance(q, dict) or not isinstance(q.get("rounds"), list) or not q["rounds"]:
            raise BenchDataError(f"{qpath} needs a non-empty \"rounds\" list")
        rounds = tuple(_parse_round(r, str(qpath)) for r in q["rounds"])
        seen_rounds = [r.id for r in rounds]
        repeated = next((rid for rid in seen_rounds if seen_rounds.count(rid) > 1), None)
        if repeated is not None:  # it would be graded and counted twice
            raise BenchDataError(f"{qpath}: round id {repeated!r} appears more than once; give each "
                                 "round its own id")
        if any(d.id == day_id for d in days):
            raise BenchDataError(f"{root / 'all_tests.json'}: day id {day_id!r} appears more than "
                                 "once; give each day its own id")
        tags = entry.get("preference_tags") or []
        if not isinstance(tags, list):
            raise BenchDataError(f"{root / 'all_tests.json'}: day {day_id}: preference_tags must "
                                 "be a list")
        seed = ()
        if entry.get("session"):
            agent = str(entry.get("agent", "metaclaw_agent"))
            seed = _seed_messages(state_dir / "agents" / agent / "sessions" / f"{entry['session']}.jsonl")
        days.append(Day(id=day_id, desc=str(entry.get("desc") or q.get("desc", "")), rounds=rounds,
                        workspace_src=workspace_src, arc=str(entry.get("arc", "")),
                        preference_tags=tuple(map(str, tags)), seed_messages=seed))
    if not days:
        raise BenchDataError(f"{root / 'all_tests.json'} lists no days")
    return Benchmark(name=str(tests.get("name", root.name)), root=root, eval_dir=eval_dir,
                     workspace_src=workspace_src, days=tuple(days))


def select_days(bench: Benchmark, days: str | Iterable[str] | None = "all") -> list[Day]:
    """The days named by ``days``: ``"all"`` / ``None``, ``"day01,day03"`` or a list of ids.

    Keeps the benchmark's order; an unknown id raises :class:`BenchDataError` listing valid ids.
    """
    if days is None or (isinstance(days, str) and days.strip().lower() in ("", "all")):
        return list(bench.days)
    wanted = [d.strip() for d in (days.split(",") if isinstance(days, str) else days) if d.strip()]
    known = {d.id for d in bench.days}
    unknown = [d for d in wanted if d not in known]
    if unknown:
        raise BenchDataError(f"unknown day(s) {', '.join(unknown)}; use 'all' or a comma list of "
                             f"{', '.join(d.id for d in bench.days)}")
    return [d for d in bench.days if d.id in set(wanted)]
