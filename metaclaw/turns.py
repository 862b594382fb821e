"""The turn types: what a recorded turn is to the loops, shared by every wing.

- ``main``: a turn of the user's task (the default);
- ``stage:<name>``: a turn of one named stage of a multi-stage task (a pipeline's ``plan``,
  ``search``, ...), given by the client only; ``<name>`` is 1-64 lowercase letters, digits,
  ``-`` or ``_``. A stage turn is a main turn with a scope: it gets skills, is judged and
  enters the support and query sets like ``main``, but it is offered only general skills and
  the skills of its own stage, and the skills learnt from its failures are scoped to its stage
  (see :attr:`metaclaw.skills.library.Skill.stage`);
- ``side``: a call beside the task; no skills, never in the support or query set.

:func:`is_task_turn` (and :data:`TASK_TURNS_SQL`, the same rule in SQL) is the one test of
"main or a stage", used wherever a turn is served skills, judged or buffered.
"""

from __future__ import annotations

import re
from typing import Any

TURN_TYPES = ("main", "side")
#: A recorded turn's status: served whole (``ok``), answered with an error (``error``), its
#: client gone before the reply ended (``client_disconnected``), or cut off by the proxy's stop
#: (``cancelled``).
TURN_STATUSES = ("ok", "error", "client_disconnected", "cancelled")
#: ``stage:<name>``: the turn type of one stage of a multi-stage task (see the module docstring).
STAGE_PREFIX = "stage:"
STAGE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
#: :func:`is_task_turn` in SQL, over the ``turns.turn_type`` column (stored lowercase).
STAGE_TURNS_SQL = f"substr(turn_type, 1, {len(STAGE_PREFIX)}) = '{STAGE_PREFIX}'"
TASK_TURNS_SQL = f"(turn_type = 'main' OR {STAGE_TURNS_SQL})"


#: A judged turn's verdict against the failure threshold ``T``: ``fail`` below it, ``pass``
#: above it, ``unclear`` at it (a tie of the judge's votes, or every vote unclear: a reward of 0
#: at the default threshold 0). One rule for every reader: the support set, the exports, the
#: judge–human agreement, the gate, experiments, the trace. A person's label, where there is
#: one, takes precedence (:data:`metaclaw.buffers.FAILURE_SQL`,
#: :data:`~metaclaw.buffers.SUCCESS_SQL`).
VERDICTS = ("pass", "fail", "unclear")


def judge_verdict(reward: Any, threshold: float = 0.0) -> str | None:
    """The judge's verdict on a turn of reward ``reward`` (None: not judged); see
    :data:`VERDICTS`."""
    if reward is None:
        return None
    reward = float(reward)
    return "fail" if reward < threshold else "pass" if reward > threshold else "unclear"


class IdentityError(ValueError):
    """A session id or turn type the client gave is not acceptable; ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


#: The longest session id a client may give.
MAX_SESSION_CHARS = 256
# printable characters only: a session id is shown in tables and terminals; and no lone
# surrogates (a header's bytes that are not UTF-8 arrive as those: the store cannot hold them,
# and would write every such id alike)
_SESSION_OK = re.compile(r"[^\x00-\x1f\x7f-\x9f\ud800-\udfff]+")


def check_session_id(value: Any, where: str) -> str:
    """A session id as given (surrounding whitespace removed), or :class:`IdentityError`
    (``where``: where it was given) saying what to send instead: a non-empty string of at most
    :data:`MAX_SESSION_CHARS` printable characters."""
    if not isinstance(value, str) or not value.strip():
        raise IdentityError("session_id", f"the session id ({where}) must be a non-empty string")
    value = value.strip()
    if len(value) > MAX_SESSION_CHARS or not _SESSION_OK.fullmatch(value):
        raise IdentityError("session_id", f"the session id ({where}) must be at most "
                                          f"{MAX_SESSION_CHARS} printable characters of UTF-8 text "
                                          "(no control characters)")
    return value


#: A person's or an agent's id: who a turn served (``X-MetaClaw-User`` / ``X-MetaClaw-Agent``,
#: ``metaclaw serve --user / --agent``) and whom a private skill is for (``person:<id>``,
#: ``agent:<id>``): 1-64 letters, digits, ``.``, ``_``, ``@``, ``+`` or ``-``, starting with a
#: letter or digit (an e-mail address or a login name fits).
PRINCIPAL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")
#: The scopes of a skill: ``shared`` with the workspace, or private to one person or one agent.
SHARED_SCOPE = "shared"
SCOPE_KINDS = ("person", "agent")


def check_principal(given: Any, param: str, where: str) -> str:
    """A person's or agent's id as given (surrounding whitespace removed), or
    :class:`IdentityError` (``param``: ``user`` or ``agent``) saying what to send instead."""
    value = given.strip() if isinstance(given, str) else None
    if value is not None and PRINCIPAL_ID.fullmatch(value):
        return value
    shown = repr(given[:80] + "..." if isinstance(given, str) and len(given) > 80 else given)
    raise IdentityError(param, f"the {'person' if param == 'user' else param} id ({where}) must "
                               "be 1-64 letters, digits, '.', '_', '@', '+' or '-', starting with "
                               f"a letter or digit (e.g. 'alice' or 'alice@example.com'), not "
                               f"{shown}")


def check_scope(given: Any) -> str:
    """A skill's scope, checked: ``shared``, ``person:<id>`` or ``agent:<id>``
    (:data:`PRINCIPAL_ID`); raises ``ValueError`` with what to write instead."""
    if isinstance(given, str):
        value = given.strip()
        if value == SHARED_SCOPE:
            return value
        kind, sep, who = value.partition(":")
        if sep and kind in SCOPE_KINDS and PRINCIPAL_ID.fullmatch(who):
            return value
    raise ValueError(f"a scope must be 'shared', 'person:<id>' or 'agent:<id>' (an id of 1-64 "
                     f"letters, digits, '.', '_', '@', '+' or '-'), not {given!r}")


def scope_visible(scope: str, person: str | None, agent: str | None) -> bool:
    """Whether a skill of ``scope`` may be offered to a turn serving ``person`` through
    ``agent`` (either ``None`` when unknown): a shared skill always; a private one only to its
    own person or agent."""
    if scope == SHARED_SCOPE:
        return True
    kind, _, who = scope.partition(":")
    return (kind == "person" and person is not None and who == person) or \
        (kind == "agent" and agent is not None and who == agent)


def is_task_turn(turn_type: str | None) -> bool:
    """Whether a turn of this type does the user's task (``main`` or ``stage:<name>``): it is
    offered skills, judged, and enters the support and query sets. ``side`` calls do not."""
    return turn_type == "main" or (isinstance(turn_type, str)
                                   and turn_type.startswith(STAGE_PREFIX))


def stage_of(turn_type: str | None) -> str | None:
    """The stage name of a ``stage:<name>`` turn type; ``None`` for ``main`` and ``side``."""
    if isinstance(turn_type, str) and turn_type.startswith(STAGE_PREFIX):
        return turn_type[len(STAGE_PREFIX):]
    return None


def stage_turn_type(stage: str) -> str:
    """``stage:<stage>``, checked (raises :class:`IdentityError` for an invalid name)."""
    return check_turn_type(f"{STAGE_PREFIX}{stage}", "stage")


def check_turn_type(given: Any, where: str = "header X-Turn-Type") -> str:
    """A client's turn type, normalised (stripped, lowercase); raises :class:`IdentityError`
    (``param='turn_type'``) with what to send instead. ``where`` names the field in the error."""
    value = given.strip().lower() if isinstance(given, str) else None
    if value in TURN_TYPES or (value is not None and value.startswith(STAGE_PREFIX)
                               and STAGE_NAME.fullmatch(value[len(STAGE_PREFIX):])):
        return value
    shown = repr(given[:80] + "..." if isinstance(given, str) and len(given) > 80 else given)
    raise IdentityError("turn_type", f"the turn type ({where}) must be 'main', 'side' or "
                                     f"'stage:<name>' with a name of 1-64 lowercase letters, "
                                     f"digits, '-' or '_' (e.g. 'stage:plan'), not {shown}")


def turn_type_condition(value: str) -> tuple[str, list[str]]:
    """An SQL condition on ``turns`` for a turn-type filter (``metaclaw turns --type``):
    ``main``, ``side``, ``stage:<name>``, or ``stage`` for every stage turn. Raises
    :class:`IdentityError` (a ``ValueError``) for anything else."""
    if isinstance(value, str) and value.strip().lower() == "stage":
        return STAGE_TURNS_SQL, []
    try:
        return "turn_type = ?", [check_turn_type(value, "filter")]
    except IdentityError as exc:
        raise IdentityError("turn_type", f"{exc}; or 'stage' for every stage") from None


def turns_filter(session: str | None = None, turn_type: str | None = None,
                 status: str | None = None) -> tuple[str, list[str]]:
    """The SQL condition and parameters selecting turns of ``session``, of ``turn_type`` (as
    :func:`turn_type_condition` reads it) and of ``status`` (:data:`TURN_STATUSES`); any may be
    left out."""
    where, params = ["1=1"], []
    if session:
        where.append("session_id = ?")
        params.append(session)
    if status:
        where.append("status = ?")
        params.append(status)
    if turn_type:
        condition, values = turn_type_condition(turn_type)
        where.append(condition)
        params += values
    return " AND ".join(where), params
