"""Secrets never leave MetaClaw: the one rule for masking them, used by the proxy, the upstream
clients, the fast loop's LLM client, ``metaclaw wire`` and the calendar signal.

The rule: every secret of at least :data:`MIN_SECRET_CHARS` characters (an upstream key, the
proxy's token, a caller's own key, the user and password in a URL and its query parameters
named like a key, :func:`url_secrets`) is replaced by :data:`MASK`
wherever it appears, in text, in bytes as relayed, and in every string of a JSON value (keys
included); a URL is shown without ``user:password@``, query or fragment (:func:`safe_url`), an
address that is itself a credential (a private calendar's) by its host alone
(:func:`url_host`). Where the secrets are not known by value (an agent's configuration file,
shown as a diff), a value is masked by where it stands (:func:`mask_config_line`): under a key
that names a secret, after ``Bearer``, or as a ``name=value`` list item.

Where a secret may go: an upstream key is sent only to the upstream's own origin
(:func:`same_origin`, :func:`upstream_key_for`); a judge or evolver elsewhere gets its own key.

A shared module: every wing may import it, and it imports nothing of the package.
"""

from __future__ import annotations

import base64
import re
from typing import Any

#: What a secret is replaced by.
MASK = "***"
#: Shorter values are not masked (masking "a" would mangle every text).
MIN_SECRET_CHARS = 4


def secrets_of(*values: str | None) -> tuple[str, ...]:
    """The values that are secrets to mask: given and at least :data:`MIN_SECRET_CHARS` long."""
    return tuple(v for v in values if v and len(v) >= MIN_SECRET_CHARS)


def same_origin(a: str, b: str) -> bool:
    """Whether two URLs share scheme, host and port (where a secret for one may go)."""
    from urllib.parse import urlsplit

    def origin(url: str) -> tuple[str, str, int | None]:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        return parts.scheme.lower(), (parts.hostname or "").lower(), port

    return origin(a) == origin(b)


def upstream_key_for(url: str | None, upstream: str | None, key_env: str) -> str | None:
    """The upstream's key (from the environment variable ``key_env``) for a judge or evolver at
    ``url`` on the upstream's own origin; elsewhere ``None``: that client reads its own key
    ($METACLAW_JUDGE_API_KEY / $METACLAW_EVOLVER_API_KEY)."""
    import os

    if url and upstream and same_origin(url, upstream):
        return os.environ.get(key_env)
    return None


#: Query parameters of a URL whose values are secrets, by a part of their name (``key``,
#: ``api-key``, ``access_token``, ``sig``, ...); others (``api-version``) are not.
_SECRET_PARAMETER = re.compile(r"key|token|secret|passw|sig|auth|credential", re.IGNORECASE)


def url_secrets(url: str | None) -> tuple[str, ...]:
    """The secrets written in ``url``: its password and the values of its query parameters
    named like a credential (:data:`_SECRET_PARAMETER`), each decoded and as written, and the
    Basic header the user and password make (an upstream that quotes its request may show
    any). The user name only where no password follows it (``https://TOKEN@host``: a token):
    masked in a reply, a name such as ``admin`` would mangle every text that says it."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    parts = urlsplit(url or "")
    found = [unquote(parts.password or ""), parts.password or ""]
    if parts.username and parts.password is None:  # ``https://TOKEN@host``: a token, not a name
        found += [unquote(parts.username), parts.username]
    if parts.username or parts.password:  # the Basic header they become, as an upstream may
        # quote it
        found.append(base64.b64encode(f"{unquote(parts.username or '')}:"
                                      f"{unquote(parts.password or '')}".encode()).decode())
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_PARAMETER.search(name):
            found.append(value)
    for pair in parts.query.split("&"):
        name, _, value = pair.partition("=")
        if _SECRET_PARAMETER.search(unquote(name)):
            found.append(value)
    return secrets_of(*dict.fromkeys(found))


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


def url_host(source: str) -> str:
    """An ``http``, ``https`` or ``webcal`` address shown as ``scheme://host/...``: its path is
    hidden with its query, fragment and ``user:password@`` (Google's private calendar address
    is a credential in its path); any other source (a file's path) is returned as it is."""
    if not source.startswith(("http://", "https://", "webcal://")):
        return source
    scheme, _, rest = source.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0].rsplit('@', 1)[-1]}/..."


# a string value under a key that names a secret (apiKey, token, password, ...), in JSON or JSON5
_KEYED_SECRET = re.compile(
    r"""(["']?[\w-]*(?:key|token|secret|password|authorization)(?:_?env)?["']?\s*[:=]\s*)"""
    r"""(["'])((?:\\.|(?!\2).)*)\2""", re.IGNORECASE)
# the same, unquoted (YAML: ``openai-api-key: sk-...``)
_BARE_KEYED_SECRET = re.compile(
    r"""^([-+ ]?\s*[\w-]*(?:key|token|secret|password|authorization)\s*:\s*)"""
    r"""([^\s"'#{\[][^\s#]*)""", re.IGNORECASE)
# a key whose value names the environment variable holding the secret (Codex's ``env_key``):
# the name is what a reader must see to know what to export
_NAMES_A_VARIABLE = re.compile(r"env_?key|key_?env", re.IGNORECASE)
# ... where the value is a variable's name indeed (the key itself put there by mistake is masked)
_VARIABLE_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
# a bearer token anywhere (a header value such as "Authorization: Bearer sk-...")
_BEARER = re.compile(r"(\bBearer\s+)[^\s\"',]+", re.IGNORECASE)
# the value of a ``name=value`` list item (aider's ``api-key:`` and ``set-env:`` lists)
_LIST_ASSIGNMENT = re.compile(r"^([-+ ]?\s*-\s*[\w.-]+\s*=\s*)(\S.*)$")


# what looks like a credential in free text (an ask): a provider's key format, a long token of
# mixed case and digits (not a path, a slug or an identifier, whose words are one case), a
# 40-character secret with "/" or "+" in it (AWS's), a JSON web token
_TOKEN_SHAPES = re.compile(
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_\w{20,}"
    r"|\bAKIA[0-9A-Z]{16}\b|\bxox[abprs]-[A-Za-z0-9-]{10,}|\bAIza[0-9A-Za-z_-]{30,}"
    r"|\beyJ[\w-]{8,}\.[\w-]{8,}\.[\w-]{8,}"
    r"|(?<![\w/+=-])(?=[\w+=-]*[A-Z])(?=[\w+=-]*[a-z])(?=[\w+=-]*\d)[\w+=-]{24,}(?![\w/+=-])"
    r"|(?<![\w/+=])(?=[\w/+]*[/+])(?=[\w/+]*[A-Z])(?=[\w/+]*[a-z])(?=[\w/+]*\d)[\w/+]{40}"
    r"(?![\w/+=])")
# a value given after a credential's name: with ":" or "=", or after "is" where it looks like
# one (a digit or a sign in it: "the password is needed" names none)
_NAMED_SECRET = re.compile(
    r"\b((?:password|passwd|passphrase|pwd|pw|secret|token|api[ _-]?key|access[ _-]?key)s?"
    r"(?:\s*[:=]\s*|\s+is\s+(?=\S*[\d!#$%&*+/=?@^_~-])|\s+(?=\S*\d)))([^\s,;]+)",
    re.IGNORECASE)
_BASIC = re.compile(r"(\bBasic\s+)[A-Za-z0-9+/=]{8,}", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^\s:/@]+:)\S+(@[^\s@/]+)", re.IGNORECASE)
_EMAIL = re.compile(r"\b[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+\b")


def mask_personal(text: str) -> str:
    """``text`` (an ask a person typed) with what must not be kept where others read it
    masked: credential-shaped tokens and values given after a name such as ``password`` or
    ``api key`` as :data:`MASK`, e-mail addresses as ``<email>``."""
    text = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}{m.group(2)}", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)}{MASK}", text)
    text = _BASIC.sub(lambda m: f"{m.group(1)}{MASK}", text)
    text = _NAMED_SECRET.sub(lambda m: f"{m.group(1)}{MASK}", text)
    text = _TOKEN_SHAPES.sub(MASK, text)
    return _EMAIL.sub("<email>", text)


def mask_config_line(line: str) -> str:
    """One line of a configuration file (JSON, JSON5, YAML; a diff's ``-``/``+``/`` `` prefix
    allowed) with :data:`MASK` for each value that stands under a key naming a secret (``key``,
    ``token``, ``secret``, ``password``, ``authorization``: quoted or not), after ``Bearer``,
    or as the value of a ``- name=value`` list item."""
    line = _KEYED_SECRET.sub(lambda m: m.group(0) if _NAMES_A_VARIABLE.search(m.group(1))
                             and _VARIABLE_NAME.fullmatch(m.group(3)) else
                             f"{m.group(1)}{m.group(2)}{MASK}{m.group(2)}", line)
    line = _BEARER.sub(lambda m: f"{m.group(1)}{MASK}", line)
    line = _LIST_ASSIGNMENT.sub(lambda m: f"{m.group(1)}{MASK}", line)
    return _BARE_KEYED_SECRET.sub(lambda m: f"{m.group(1)}{MASK}", line)
