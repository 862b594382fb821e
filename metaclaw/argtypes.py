"""argparse types for the command line: a nonsense value is a usage error with one clear
sentence, never silently replaced, run as zero rounds or turned into a proxy that injects
nothing."""

from __future__ import annotations

import argparse
import math


#: The largest whole number a value may be (SQLite's integers are 64-bit).
MAX_INT = 2**63 - 1


def principal(text: str) -> str:
    """A person's or agent's id (:data:`metaclaw.turns.PRINCIPAL_ID`)."""
    from metaclaw.turns import IdentityError, check_principal

    try:
        return check_principal(text, "user", "option")
    except IdentityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def token(text: str) -> str:
    """A secret clients must send: not empty (``--token "$UNSET"`` would turn authentication
    off without a word), no white space or control character (no header could carry it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the token is empty (an unset variable?): give a token, "
                                         "or leave --token out to serve without one")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise argparse.ArgumentTypeError("the token holds white space or a control character, "
                                         "which no Authorization header can carry")
    return text


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = _whole(text, "1 or more")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small; give 1 or more")
    return value


def group_size(text: str) -> int:
    """An integer of at least 2: GRPO compares the samples of a group with each other."""
    value = _whole(text, "2 or more")
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} is too small; give 2 or more (GRPO compares "
                                         "the samples of a group with each other)")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    value = _whole(text, "0 or more")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 or more")
    return value


def _whole(text: str, wanted: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give {wanted}") from None
    if value > MAX_INT:
        raise argparse.ArgumentTypeError(f"{text} is too large; give at most {MAX_INT}")
    return value


def port(text: str) -> int:
    """A TCP port: 0 (any free port) to 65535."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port; give 0 (any free port) to 65535")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (a timeout in seconds)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not above 0")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of 0 or more (a wait in seconds, 0: none)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is below 0")
    return value


def finite_float(text: str) -> float:
    """A finite number (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def day_list(text: str) -> str:
    """``all`` or a comma-separated list naming at least one day id."""
    if text.strip().lower() == "all":
        return "all"
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if not ids:
        raise argparse.ArgumentTypeError(f"{text!r} names no day; give 'all' or day ids separated "
                                         "by commas, as the data folder's eval/ names them")
    return ",".join(ids)


def check_min_score(min_score: float | None, retrieval: str) -> str | None:
    """Why ``min_score`` cannot be a threshold for ``retrieval`` (None when it can).

    Embedding retrieval scores are cosines (-1 to 1); hybrid scores (the default, ``auto``) a
    cosine plus a lexical bonus under 1; lexical (BM25) scores are 0 or more with no upper
    bound, so any threshold of 0 or more is a real, if strict, choice there.
    """
    if min_score is None:
        return None
    if retrieval == "lexical":
        return None if min_score >= 0 else (f"--min-score {min_score:g} is below 0, and lexical "
                                            "(BM25) scores are never negative; give 0 or more")
    if retrieval in ("hybrid", "auto"):
        # a cosine plus a lexical bonus of at most the hybrid's weight (under 1)
        return None if -1.0 <= min_score <= 2.0 else (
            f"--min-score {min_score:g} is outside -1..2, the range of {retrieval} retrieval's "
            "scores (a cosine plus a lexical bonus); give a value in that range")
    if not -1.0 <= min_score <= 1.0:
        return (f"--min-score {min_score:g} is outside -1..1, the range of {retrieval} retrieval's "
                "cosine scores; give a value in that range")
    return None
