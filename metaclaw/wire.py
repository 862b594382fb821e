"""Put a real agent behind the proxy: patch its provider configuration, show the diff, undo it.

OpenClaw (``metaclaw wire openclaw``). OpenClaw reads a JSON5 file: ``$OPENCLAW_CONFIG_PATH``,
else ``$OPENCLAW_STATE_DIR/openclaw.json``, else ``~/.openclaw/openclaw.json``. Models come from
``models.providers.<name>`` (``baseUrl``, ``apiKey``, ``api``, optional static ``headers``,
``models``), and the agent's model is ``agents.defaults.model.primary = "<provider>/<model>"``.
Wiring adds a provider ``metaclaw`` pointing at the proxy (``api: openai-completions``, the
proxy token as its key, the models of the provider the agent used) and makes it the primary;
the original provider is left as it was, and ``metaclaw serve --upstream`` gets its URL (the
command to run is printed). OpenClaw's static headers cannot carry a per-session id; the wired models set
``compat.supportsPromptCacheKey`` so that OpenClaw sends ``prompt_cache_key: "<sessionId>:<n>"``
on every turn (without it, OpenClaw still writes ``sessionId=<uuid>`` into each session's first
message); :mod:`metaclaw.sessions` reads either, and side calls are recognised by their content.

Wiring keeps the file's exact bytes in ``<config>.metaclaw-backup`` (JSON5 comments
included; the patched file itself is written as plain JSON, which JSON5 accepts); ``--undo``
restores them when the file is still as wired, and otherwise removes only what wiring added.
Every write goes to a temporary file that then replaces the target, so a crash never leaves a
half-written file; the config's mode and owner are kept (it holds API keys), and a symlinked
config (dotfile managers) stays a symlink: the file it points to is the one rewritten.

Any other OpenAI-compatible agent: point its base URL at ``http://127.0.0.1:<port>/v1`` and
its API key at the proxy token (README, "Point a real agent at the proxy").
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROVIDER = "metaclaw"
BACKUP_SUFFIX = ".metaclaw-backup"
STATE_SUFFIX = ".metaclaw-wire.json"
# a string value under a key that names a secret (apiKey, token, password, ...), in JSON or JSON5
_SECRET = re.compile(r"""(["']?[\w-]*(?:key|token|secret|password|authorization)["']?\s*:\s*)"""
                     r"""(["'])((?:\\.|(?!\2).)*)\2""", re.IGNORECASE)


def _redact(line: str) -> str:
    return _SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}***{m.group(2)}", line)


class WireError(RuntimeError):
    """The agent's configuration cannot be wired; the message says what to change."""


@dataclass
class WirePlan:
    """What wiring would do: ``before`` / ``after`` file texts, where the agent's model was
    served (``upstream``, ``model``), and the ``serve`` command to run."""

    path: Path
    before: str
    after: str
    upstream: str | None
    model: str
    primary_before: str | None
    original: bytes | None = None  # the file's exact bytes; None when there is no file

    @property
    def diff(self) -> str:
        """The change, with the proxy token and API keys masked (it is shown on the terminal)."""
        return "".join(_redact(line) for line in difflib.unified_diff(
            self.before.splitlines(keepends=True), self.after.splitlines(keepends=True),
            fromfile=f"{self.path} (now)", tofile=f"{self.path} (wired)"))

    def serve_command(self, port: int) -> str:
        upstream = self.upstream or "<your provider's OpenAI-compatible base URL>"
        return (f"METACLAW_UPSTREAM_API_KEY=<the provider's key> metaclaw serve --upstream "
                f"{upstream} --model {self.model} --port {port}")


def openclaw_config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Where OpenClaw reads its configuration (see the module docstring)."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("OPENCLAW_CONFIG_PATH"):
        return Path(os.environ["OPENCLAW_CONFIG_PATH"]).expanduser()
    state = os.environ.get("OPENCLAW_STATE_DIR")
    return (Path(state).expanduser() if state else Path.home() / ".openclaw") / "openclaw.json"


def _read(path: Path) -> tuple[bytes | None, str, dict[str, Any]]:
    """The file's exact bytes (None when missing), its text and the object it holds."""
    import json5

    if not path.exists():
        return None, "", {}
    try:
        raw = path.read_bytes()  # bytes, not text: line endings and a BOM survive the backup
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise WireError(f"{path} is not UTF-8 text; fix the file or pass --config") from None
    except OSError as exc:
        raise WireError(f"cannot read {path} ({exc.strerror}); fix it or pass --config") from None
    try:  # plain JSON (as wiring writes it) first: the json5 parser is slow on big files
        config = json.loads(text) if text.strip() else {}
    except ValueError:
        config = None
    try:
        config = json5.loads(text) if config is None else config
    except (ValueError, RecursionError) as exc:
        raise WireError(f"cannot read {path} as JSON5 ({exc}); fix the file or pass --config") \
            from None
    if not isinstance(config, dict):
        raise WireError(f"{path} does not hold a JSON object; fix the file or pass --config")
    return raw, text, config


def _writable(path: Path) -> None:
    # a config the user made read-only is a choice to respect, not to replace around
    if path.exists() and (not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222):
        raise WireError(f"{path} is read-only; make it writable (chmod u+w) to change it")


def _write(path: Path, data: bytes, like: Path | None = None) -> None:
    """Replace ``path`` with ``data`` atomically, with the mode and owner of ``like`` (else
    readable by the owner only: these files hold API keys)."""
    target = path.resolve()  # a symlink stays a symlink: replace the file it points to
    like_stat = like.stat() if like is not None and like.exists() else None
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                               suffix=".metaclaw-tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())  # on disk before the rename: a power cut leaves old or new
        if like_stat is not None:
            os.chmod(tmp, stat.S_IMODE(like_stat.st_mode))
            try:
                os.chown(tmp, like_stat.st_uid, like_stat.st_gid)
            except PermissionError:  # only root can give a file away; the user's own stays theirs
                pass
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _dig(config: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config


def plan_openclaw(config_path: Path, proxy_url: str, *, token: str | None = None,
                  model: str | None = None) -> WirePlan:
    """The wiring of the OpenClaw configuration at ``config_path`` to the proxy at
    ``proxy_url`` (``http://host:port/v1``); nothing is written."""
    original, before, config = _read(config_path)
    primary = _dig(config, "agents", "defaults", "model", "primary")
    if isinstance(primary, dict):  # older layouts keep {"primary": {...}}
        primary = None
    source_name, _, source_model = (primary or "").partition("/")
    if source_name == PROVIDER:
        raise WireError(f"{config_path} is already wired to MetaClaw (primary model {primary}); "
                        "run `metaclaw wire openclaw --undo` first to re-wire")
    providers = _dig(config, "models", "providers") or {}
    source = providers.get(source_name) if isinstance(providers, dict) else None
    model = model or source_model
    if not model:
        raise WireError(f"{config_path} names no primary model (agents.defaults.model.primary); "
                        "pass --model NAME (the model the proxy should serve)")
    models = [dict(m) for m in (source or {}).get("models") or [] if isinstance(m, dict)]
    if not any(m.get("id") == model for m in models):
        models.append({"id": model, "name": model, "input": ["text"], "contextWindow": 128000,
                       "maxTokens": 8192})
    for entry in models:  # OpenClaw then sends its session id as prompt_cache_key on every turn
        entry["compat"] = {**(entry.get("compat") or {}), "supportsPromptCacheKey": True}
    wired = json.loads(json.dumps(config))
    wired.setdefault("models", {}).setdefault("providers", {})[PROVIDER] = {
        "baseUrl": proxy_url, "apiKey": token or "metaclaw", "api": "openai-completions",
        "headers": {"X-MetaClaw-Client": "openclaw"}, "models": models}
    if "mode" not in wired["models"]:
        wired["models"]["mode"] = "merge"  # keep OpenClaw's built-in providers
    defaults = wired.setdefault("agents", {}).setdefault("defaults", {})
    if not isinstance(defaults.get("model"), dict):
        defaults["model"] = {}
    defaults["model"]["primary"] = f"{PROVIDER}/{model}"
    upstream = (source or {}).get("baseUrl")
    return WirePlan(config_path, before, json.dumps(wired, indent=2, ensure_ascii=False) + "\n",
                    upstream if isinstance(upstream, str) else None, model, primary, original)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def apply(plan: WirePlan) -> None:
    """Write the wired configuration, keeping the original bytes for :func:`undo`."""
    path = plan.path
    backup, state = Path(f"{path}{BACKUP_SUFFIX}"), Path(f"{path}{STATE_SUFFIX}")
    _writable(path)
    path.resolve().parent.mkdir(parents=True, exist_ok=True)
    after = plan.after.encode("utf-8")
    if plan.original is not None:
        # the file as it is now, even if an earlier wiring left a backup: undo gives back what
        # the user had just before this wiring, edits since the earlier one included
        _write(backup, plan.original, like=path)
    _write(state, json.dumps({"written_sha256": _sha(after), "existed": plan.original is not None,
                              "primary_before": plan.primary_before}).encode("utf-8"))
    _write(path, after, like=path)


def undo(config_path: Path) -> str:
    """Restore the configuration as it was before wiring; returns what was done."""
    backup, state = Path(f"{config_path}{BACKUP_SUFFIX}"), Path(f"{config_path}{STATE_SUFFIX}")
    if not state.exists():
        raise WireError(f"{config_path} was not wired by metaclaw (no {state.name}); nothing to "
                        "undo")
    info = json.loads(state.read_text(encoding="utf-8"))
    current, _, config = _read(config_path)
    existed = info.get("existed")
    as_wired = current is not None and _sha(current) == info["written_sha256"]
    if as_wired and not existed:
        _writable(config_path)
        config_path.unlink()
        done = f"removed {config_path}: there was none before wiring"
    elif as_wired and backup.exists():  # without the backup, only taking back the wiring is safe
        _writable(config_path)
        _write(config_path, backup.read_bytes(), like=config_path)
        done = f"restored {config_path} exactly as it was before wiring"
    else:  # edited since: take back only what wiring added
        providers = _dig(config, "models", "providers")
        removed = isinstance(providers, dict) and providers.pop(PROVIDER, None) is not None
        model = _dig(config, "agents", "defaults", "model")
        if isinstance(model, dict) and str(model.get("primary", "")).startswith(f"{PROVIDER}/"):
            if info.get("primary_before"):
                model["primary"] = info["primary_before"]
            else:
                model.pop("primary")
            removed = True
        if removed:
            _writable(config_path)
            _write(config_path, (json.dumps(config, indent=2, ensure_ascii=False) + "\n")
                   .encode("utf-8"), like=config_path)
            done = (f"{config_path} changed since wiring: removed the '{PROVIDER}' provider and "
                    f"restored the primary model ({info.get('primary_before') or 'unset'}); other "
                    "edits kept")
        else:  # e.g. a wiring cut short before the file was replaced: keep it byte for byte
            done = f"{config_path} holds no MetaClaw wiring; left as it is"
    backup.unlink(missing_ok=True)
    state.unlink(missing_ok=True)
    return done
