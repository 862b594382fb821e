"""Grade a round: run a file check in the workspace, or score a multiple-choice reply.

File checks: the round's shell command runs with the workspace as working directory and a
timeout. ``python scripts/check_x.py`` is rewritten to the packaged checker
(``<this python> -S -P -m metaclaw.bench.scripts.check_x``) and any other ``python`` to this
interpreter. ``-P`` keeps the workspace off ``sys.path``, so files the agent wrote there cannot
shadow the checker or the standard library. ``-S`` skips the ``site`` start-up work (the slowest
part of starting Python in a large environment); instead ``PYTHONPATH`` names the folder holding
this package and this interpreter's ``site-packages``, so the same modules stay importable. When
``PYTHONDONTWRITEBYTECODE`` is set, the checkers' bytecode is cached under the temporary folder
(``PYTHONPYCACHEPREFIX``) rather than recompiled by every check, never next to the sources.

Multiple choice: the first ``\\bbox{...}`` or ``\\boxed{...}`` in the reply is the answer, read
as its standalone single letters (``\\text{A, C}`` selects A and C, not the letters of "text"); the
score is ``1 - (false positives + false negatives) / number of options`` (at least 0); no box is a
format error with score 0. A round passes when its score is 1.

Feedback for the next round follows the data's ``[Previous Feedback]`` protocol.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from metaclaw.bench.data import Round
from metaclaw.bench.graders import CLIS, INITIAL_FILES_ENV

CONTINUE_REMINDER = "Keep this in mind as you continue with the next task."
FORMAT_ERROR = (r"Note: your previous response did not include a \bbox{X} answer "
                r"(e.g. \bbox{A} for a single option, or \bbox{A,B} for multiple options). "
                + CONTINUE_REMINDER)
FEEDBACK_MARKER = "[Previous Feedback]"

_BOX_OPEN = re.compile(r"\\(?:bbox|boxed)\{")
_MACRO = re.compile(r"\\[A-Za-z]+\s*")     # \text, \mathrm, ... : unwrapped, only their argument counts
_PYTHON = re.compile(r"(?<![\w./-])python3?(?:\s+(?:\./)?scripts/(?P<script>check_\w+)\.py)?(?=\s|$)")


@dataclass
class CheckResult:
    """The outcome of a file check: ``passed`` when the exit code was the expected one."""

    passed: bool
    exit_code: int
    stdout: str
    stderr: str
    command: str
    duration_s: float = 0.0
    timed_out: bool = False

    def to_dict(self) -> dict:
        return {"exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr,
                "command": self.command, "duration_s": round(self.duration_s, 3),
                "timed_out": self.timed_out}


@dataclass
class ChoiceScore:
    """The outcome of a multiple-choice reply."""

    score: float
    passed: bool
    format_valid: bool
    selected: list[str] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)
    false_positives: list[str] = field(default_factory=list)
    false_negatives: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"selected": self.selected, "answer": self.answer, "format_valid": self.format_valid,
                "false_positives": self.false_positives, "false_negatives": self.false_negatives}


def rewrite_command(command: str, python: str | None = None) -> str:
    """The round's command with ``python scripts/check_*.py`` and ``python`` made safe to run.

    Known checkers run as packaged modules; an unknown ``scripts/check_*.py`` is left as a path
    (it does not exist in the workspace, so the check fails with Python's own message).
    """
    exe = shlex.quote(python or sys.executable)

    def replace(m: re.Match) -> str:
        script = m.group("script")
        if script is None:
            return f"{exe} -S -P"
        if script in CLIS:
            return f"{exe} -S -P -m metaclaw.bench.scripts.{script}"
        return f"{exe} -S -P scripts/{script}.py"

    return _PYTHON.sub(replace, command)


def _import_paths() -> list[str]:
    """Folders that make this package and the installed packages importable without ``site``."""
    paths = [str(Path(__file__).resolve().parents[2])]  # the folder holding the package
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path and path not in paths:
            paths.append(path)
    return paths


def unsafe_names(workspace: str | Path, initial_files: list[str] | None = None) -> list[str]:
    """Files written during the day (not in ``initial_files``) whose name holds whitespace or
    whose name (or a folder on its path) starts with ``-``, as workspace-relative paths."""
    root = Path(workspace)
    initial = set(initial_files or ())
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if rel in initial:
                continue
            if any(re.search(r"\s", part) or part.startswith("-") for part in rel.split("/")):
                out.append(rel)
    return sorted(out)


def run_check(round_: Round | dict, workspace: str | Path, *, timeout: float = 60.0,
              initial_files: list[str] | None = None) -> CheckResult:
    """Run a ``file_check`` round's command in ``workspace``; passes when the exit code matches.

    ``initial_files``: files present when the day began (workspace-relative); handed to the
    checkers through a manifest outside the workspace so inputs are not graded as outputs.
    """
    ev = round_.eval if isinstance(round_, Round) else round_.get("eval", round_)
    command = rewrite_command(str(ev.get("command", "")))
    expect = int(ev.get("expect_exit", 0))
    timeout = float(ev.get("timeout", timeout))
    unsafe = unsafe_names(workspace, initial_files)
    if unsafe:  # the command word-splits globbed names: such a name could steer the checker
        return CheckResult(False, -1, "", f"the check fails: the file name {unsafe[0]!r} holds "
                           "whitespace or starts with '-', which a shell command would split or "
                           "read as an option", command)
    env = dict(os.environ)
    # relative PYTHONPATH entries would name the workspace: keep only absolute ones
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    env["PYTHONPATH"] = os.pathsep.join(_import_paths() + inherited)
    if env.pop("PYTHONDONTWRITEBYTECODE", None):  # cache bytecode, but never next to the sources
        env.setdefault("PYTHONPYCACHEPREFIX",
                       str(Path(tempfile.gettempdir()) / "metaclaw-bench-pycache"))
    manifest = None
    if initial_files is not None:
        fd, manifest = tempfile.mkstemp(prefix="metaclaw-bench-initial-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(list(initial_files), fh)
        env[INITIAL_FILES_ENV] = manifest
    started = time.perf_counter()
    try:
        proc = subprocess.Popen(command, shell=True, cwd=str(workspace), env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            return CheckResult(False, -1, out, (err + f"\ncheck timed out after {timeout:g} s").strip(),
                               command, time.perf_counter() - started, timed_out=True)
        code = proc.returncode
        return CheckResult(code == expect, code, out, err, command, time.perf_counter() - started)
    except OSError as exc:
        return CheckResult(False, -1, "", f"could not run the check: {exc}", command,
                           time.perf_counter() - started)
    finally:
        if manifest:
            os.unlink(manifest)


def _box_content(reply: str) -> str | None:
    """The text inside the first ``\\bbox{..}``/``\\boxed{..}``, nested braces included
    (None when there is no box, or it is never closed)."""
    m = _BOX_OPEN.search(reply)
    if not m:
        return None
    depth, start = 1, m.end()
    for i in range(start, len(reply)):
        depth += {"{": 1, "}": -1}.get(reply[i], 0)
        if depth == 0:
            return reply[start:i]
    return None   # an unclosed box is no answer


def _option_letters(token: str) -> bool:
    """Whether ``token`` names options: one letter (``a``, ``C``), or capitals run together
    without a repeat (``AC``, a common way to write ``A,C``); not a word (``Answer``, ``and``)."""
    if not (token.isascii() and token.isalpha()):
        return False
    return len(token) == 1 or (token.isupper() and len(set(token)) == len(token))


def extract_choice(reply: str | None) -> list[str] | None:
    """Option letters of the first ``\\bbox{..}``/``\\boxed{..}`` in ``reply`` (sorted), or None.

    Only standalone letters count (``A, C``, ``A and C``, ``\\text{A,C}``, ``AC``); words such as
    ``Answer:`` or ``both`` are ignored, so their letters are never read as selected options.
    """
    content = _box_content(reply or "")
    if content is None:
        return None
    content = _MACRO.sub(" ", content).replace("{", " ").replace("}", " ")
    tokens = (t.strip(".:()[]'\"*") for t in re.split(r"[\s,;/&+]+|\band\b", content))
    letters = sorted({c.upper() for t in tokens if _option_letters(t) for c in t})
    return letters or None


def score_choice(reply: str | None, round_: Round | dict) -> ChoiceScore:
    """Score a multiple-choice reply: ``1 - (FP + FN) / number of options``, 0 without a box."""
    ev = round_.eval if isinstance(round_, Round) else round_.get("eval", round_)
    options = sorted(str(k).upper() for k in ev.get("options", {}))
    raw = ev.get("answer", [])
    answer = sorted({str(a).strip().upper() for a in (raw if isinstance(raw, list) else list(str(raw)))
                     if str(a).strip()})
    selected = extract_choice(reply)
    if selected is None:
        return ChoiceScore(0.0, False, False, [], answer, [], answer)
    fp = [s for s in selected if s not in answer]
    fn = [a for a in answer if a not in selected]
    n = max(len(options), len(set(answer)), 1)
    score = max(0.0, 1.0 - (len(fp) + len(fn)) / n)
    return ChoiceScore(score, score == 1.0, True, selected, answer, fp, fn)


def feedback_text(round_: Round, passed: bool, choice: ChoiceScore | None = None) -> str:
    """The feedback the agent sees before the next round (upstream's wording).

    File checks: ``feedback.correct`` or ``feedback.incorrect`` + a reminder. Multiple choice:
    ``feedback.correct`` when right, else one line per missed / wrongly picked option, or the
    format error when there was no box.
    """
    fb = round_.feedback or {}
    if round_.type == "multi_choice" and choice is not None:
        if not choice.format_valid:
            return FORMAT_ERROR
        if choice.passed:
            return str(fb.get("correct", ""))
        explain = fb.get("options", {}) or {}
        lines = [f"You missed option {o}: {explain.get(o, '')}".rstrip() for o in choice.false_negatives]
        lines += [f"You incorrectly selected option {o}: {explain.get(o, '')}".rstrip()
                  for o in choice.false_positives]
        return "\n".join(lines + [CONTINUE_REMINDER])
    text = str(fb.get("correct" if passed else "incorrect", ""))
    if not passed and text:
        text = f"{text}\n{CONTINUE_REMINDER}"
    return text


def with_feedback(feedback: str | None, question: str) -> str:
    """``[Previous Feedback] <feedback>`` + blank line + the question (just the question if none)."""
    return f"{FEEDBACK_MARKER} {feedback}\n\n{question}" if feedback else question


def standalone_feedback(feedback: str) -> str:
    """The feedback of a day's last round, sent on its own after that round."""
    return f"{FEEDBACK_MARKER} {feedback}"
