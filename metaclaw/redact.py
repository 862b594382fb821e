"""Secrets never leave MetaClaw: the one rule for masking them, used by the proxy, the upstream
clients and the fast loop's LLM client.

The rule: every secret of at least :data:`MIN_SECRET_CHARS` characters (an upstream key, the
proxy's token, a caller's own key, the user and password in a URL) is replaced by :data:`MASK`
wherever it appears, in text, in bytes as relayed, and in every string of a JSON value (keys
included); a URL is shown without ``user:password@``, query or fragment (:func:`safe_url`).
"""

from __future__ import annotations

from typing import Any

#: What a secret is replaced by.
MASK = "***"
#: Shorter values are not masked (masking "a" would mangle every text).
MIN_SECRET_CHARS = 4


def secrets_of(*values: str | None) -> tuple[str, ...]:
    """The values that are secrets to mask: given and at least :data:`MIN_SECRET_CHARS` long."""
    return tuple(v for v in values if v and len(v) >= MIN_SECRET_CHARS)


def url_credentials(url: str | None) -> tuple[str, str]:
    """The password and the user name written in ``url`` (decoded; "" when absent)."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url or "")
    return unquote(parts.password or ""), unquote(parts.username or "")


def mask(text: str | None, secrets: tuple[str, ...]) -> str | None:
    """``text`` with each of ``secrets`` replaced by :data:`MASK`."""
    if not text:
        return text
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def mask_bytes(data: bytes, secrets: tuple[bytes, ...]) -> bytes:
    """``data`` (a reply or stream events as relayed) with ``secrets`` (encoded) masked."""
    for secret in secrets:
        if secret in data:
            data = data.replace(secret, MASK.encode())
    return data


def mask_json(value: Any, secrets: tuple[str, ...]) -> Any:
    """A JSON value with ``secrets`` masked in every string (keys included)."""
    if not secrets:
        return value
    if isinstance(value, str):
        return mask(value, secrets)
    if isinstance(value, dict):
        return {mask_json(k, secrets): mask_json(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_json(v, secrets) for v in value]
    return value


def masked_url(url: str) -> str:
    """``url`` with its passwords replaced by ``***`` (the one in ``user:password@`` and a
    ``password=`` query parameter), the rest kept: for a database URL, whose user, host and
    query (a socket folder, ``sslmode``) say which database it is. :func:`safe_url` drops more."""
    from urllib.parse import parse_qsl, urlencode, urlsplit

    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        user, host = netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}:***@{host}"
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k == "password" for k, _ in pairs):
        query = urlencode([(k, "***" if k == "password" else v) for k, v in pairs], safe="/*")
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def safe_url(url: str | None) -> str | None:
    """``url`` without ``user:password@``, query or fragment (for logs, errors and health output)."""
    from urllib.parse import urlsplit, urlunsplit

    if not url:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1], query="", fragment=""))
