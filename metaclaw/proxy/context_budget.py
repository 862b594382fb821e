"""The context budget: the injected skill block never pushes a request past the model's window.

For a model whose context window is known (``ProxyConfig.context_windows``, else
:data:`KNOWN_WINDOWS` by name prefix, else ``ProxyConfig.context_window``; unknown means no
check and no cost), the proxy counts the client's request, reserves the output it asked for
(``max_tokens`` / ``max_completion_tokens``), and keeps only as many of the selected skills,
best first, as fit in what is left. Skills are cut, never the client's messages. A request that
is already over the window on its own is forwarded untouched (no skills, a logged warning) so the
upstream answers it as it would without the proxy. What was cut is recorded with the turn
(column ``context_budget``).

Counting: with ``ProxyConfig.tokenizer`` (a ``tokenizer.json`` path for the ``tokenizers``
library, or any callable ``str -> int``) tokens are counted by that tokenizer; it should be the
served model's. Otherwise the count is an *estimate*: UTF-8 bytes / 3, rounded up. Real tokenizers
average about 4 bytes per token on English prose and code and about 3 on JSON-heavy agent
requests, so the estimate errs on the side of cutting a skill rather than overflowing; the
request is measured as its JSON body, whose punctuation also over-counts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

log = logging.getLogger("metaclaw.proxy")

#: Context windows (tokens) by model-name prefix, longest prefix wins. Configure others with
#: ``ProxyConfig.context_windows``.
KNOWN_WINDOWS: dict[str, int] = {
    "claude-": 200_000,
    "gpt-4o": 128_000,
    "gpt-4.1": 1_047_576,
    "gpt-4-turbo": 128_000,
    "gpt-3.5-turbo": 16_385,
    "o1": 200_000,
    "o3": 200_000,
    "o4-mini": 200_000,
    "SmolLM2": 8_192,
    "smollm2": 8_192,
}
#: The most output tokens a model produces in one reply, by model-name prefix (longest prefix
#: wins; the providers' published limits). A request translated from another protocol asks for
#: what its client's own model allows (Claude Code: 128,000), which a model with a lower limit
#: refuses with a 400: the proxy asks for at most this much instead, and reserves no more in the
#: budget. Configure others with ``ProxyConfig.max_output_tokens``.
KNOWN_OUTPUT_LIMITS: dict[str, int] = {
    "gpt-4o": 16_384,
    "gpt-4o-2024-05-13": 4_096,
    "gpt-4.1": 32_768,
    "gpt-4-turbo": 4_096,
    "gpt-3.5-turbo": 4_096,
    "o1": 100_000,
    "o1-mini": 65_536,
    "o1-preview": 32_768,
    "o3": 100_000,
    "o4-mini": 100_000,
    "claude-3-haiku": 4_096,
    "claude-3-sonnet": 4_096,
    "claude-3-opus": 4_096,
    "claude-3-5-haiku": 8_192,
    "claude-3-5-sonnet": 8_192,
    "claude-3-5-sonnet-20240620": 4_096,
}  # newer Claude models differ by minor version (and give more): --max-output-tokens
#: Tokens counted for the wrapping of the injected block (a system block or message).
BLOCK_OVERHEAD = 8
ESTIMATE_BYTES_PER_TOKEN = 3


def _by_prefix(table: dict[str, int], model: str) -> int | None:
    best = max((p for p in table if model.startswith(p)), key=len, default=None)
    return table[best] if best else None


def context_window(model: str, configured: dict[str, int] | None,
                   default: int | None) -> int | None:
    """The window of ``model``: configured exactly, else the longest known prefix, else
    ``default`` (``None``: unknown, no budget check)."""
    if configured and model in configured:
        return configured[model]
    known = _by_prefix(KNOWN_WINDOWS, model)
    return known if known is not None else default


def output_limit(model: str, default: int | None) -> int | None:
    """The most output tokens ``model`` gives in one reply: the longest known prefix
    (:data:`KNOWN_OUTPUT_LIMITS`), else ``default`` (``None``: unknown), as
    :func:`context_window` reads windows."""
    known = _by_prefix(KNOWN_OUTPUT_LIMITS, model)
    return known if known is not None else default


class TokenCounter:
    """Counts tokens with a real tokenizer when given one, else estimates (see module doc).

    ``tokenizer``: ``None`` (estimate), a path to a ``tokenizer.json``, or a callable
    ``str -> int``. :attr:`method` names what counted (recorded with the turn).
    """

    def __init__(self, tokenizer: str | Callable[[str], int] | None = None):
        self._count: Callable[[str], int] | None = None
        self.method = "estimate"
        if callable(tokenizer):
            self._count, self.method = tokenizer, "tokenizer"
        elif tokenizer:
            # The tokenizers library raises a bare ``Exception("No such file or directory (os
            # error 2)")`` that names no path: say which setting to change instead.
            try:
                from tokenizers import Tokenizer

                loaded = Tokenizer.from_file(str(tokenizer))
            except ImportError:
                raise ValueError(f"tokenizer {str(tokenizer)!r} needs the tokenizers package: "
                                 "pip install tokenizers, or leave the tokenizer unset to "
                                 "estimate") from None
            except Exception as exc:
                raise ValueError(f"cannot load the tokenizer {str(tokenizer)!r} ({exc}); set the "
                                 "tokenizer to a tokenizer.json file, or leave it unset to "
                                 "estimate") from None
            self._count = lambda text: len(loaded.encode(text, add_special_tokens=False).ids)
            self.method = f"tokenizer:{tokenizer}"

    def count(self, text: str | bytes) -> int:
        if self._count is None:
            size = len(text) if isinstance(text, bytes) else len(text.encode())
            return math.ceil(size / ESTIMATE_BYTES_PER_TOKEN)
        return self._count(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


@dataclass
class Budget:
    """What the budget decided for one turn."""

    keep: int                  # how many of the selected skills (best first) are injected
    record: dict[str, Any]     # recorded with the turn (column ``context_budget``)


def fit_skills(names: Sequence[str], render: Callable[[int], str], request: bytes,
               window: int, reserve: int | None, counter: TokenCounter) -> Budget:
    """How many of the selected skills fit: ``render(n)`` is the block of the best ``n``.

    ``request`` is the client's request body as received (JSON bytes); ``reserve`` the output
    tokens it asked for. Skills are dropped from the lowest-ranked up until the block fits in
    ``window - request - reserve``.
    """
    request_tokens = counter.count(request)
    reserve = reserve or 0
    available = window - request_tokens - reserve
    record: dict[str, Any] = {"window": window, "request_tokens": request_tokens,
                              "reserved_output": reserve, "method": counter.method}
    if available < 0:
        log.warning("request of %d tokens (+%d reserved for output) is already over the %d-token "
                    "window: forwarded untouched, without skills", request_tokens, reserve, window)
        return Budget(0, {**record, "over_window": True, "block_tokens": 0, "cut": list(names)})
    keep = len(names)
    block_tokens = 0
    while keep > 0:
        block_tokens = counter.count(render(keep)) + BLOCK_OVERHEAD
        if block_tokens <= available:
            break
        keep -= 1
    if keep == 0:
        block_tokens = 0
    return Budget(keep, {**record, "over_window": False, "block_tokens": block_tokens,
                         "cut": list(names[keep:])})
