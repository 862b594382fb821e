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
message); :mod:`metaclaw.proxy.sessions` reads either, and side calls are recognised by their content.

Wiring changes only the keys it sets: the file is edited as text (:mod:`metaclaw.jsontext`), so
its comments, key order and layout stay (a file that cannot be edited so is written whole as
plain JSON, which JSON5 accepts). It keeps the file's exact bytes in ``<config>.metaclaw-backup``;
``--undo`` restores them when the file is still as wired, and otherwise takes back only what
wiring added, in the same way.
Every write goes to a temporary file that then replaces the target, so a crash never leaves a
half-written file; the config's mode and owner are kept (it holds API keys), and a symlinked
config (dotfile managers) stays a symlink: the file it points to is the one rewritten.

Two ``metaclaw wire`` processes on one config take turns: each change is made while holding an
exclusive lock (:mod:`filelock`) on ``<config>.metaclaw.lock`` beside the file the config
resolves to (so a symlink and its target share one lock). A wiring planned from a file that
another process changed meanwhile is refused rather than written over it, and a lock still held
after :data:`LOCK_TIMEOUT` seconds is an error that says so. The lock file holds nothing (no key
ever lands in it) and is removed when the change is done.

Any other OpenAI-compatible agent: point its base URL at ``http://127.0.0.1:<port>/v1`` and
its API key at the proxy token (docs/how-to/wire-agents.md).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from metaclaw import jsontext
from metaclaw.fileio import write_atomic
from metaclaw.redact import mask_config_line

PROVIDER = "metaclaw"
BACKUP_SUFFIX = ".metaclaw-backup"
STATE_SUFFIX = ".metaclaw-wire.json"
LOCK_SUFFIX = ".metaclaw.lock"
#: Seconds a change waits for another ``metaclaw wire`` on the same config to finish.
LOCK_TIMEOUT = 10.0
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
    agent: str = "openclaw"
    #: what undoing takes back when the file was edited since wiring (see :func:`_unwire`)
    restore: dict[str, Any] | None = None
    upstream_protocol: str = "openai"

    @property
    def diff(self) -> str:
        """The change, with the proxy token and API keys masked (it is shown on the terminal)."""
        return "".join(mask_config_line(line) for line in difflib.unified_diff(
            self.before.splitlines(keepends=True), self.after.splitlines(keepends=True),
            fromfile=f"{self.path} (now)", tofile=f"{self.path} (wired)"))

    def serve_command(self, port: int, token: bool = False) -> str:
        """The ``metaclaw serve`` line this wiring needs; ``token``: with the proxy token given
        to ``wire`` on its command line (one read from ``$METACLAW_PROXY_TOKEN`` serve reads
        too)."""
        upstream = self.upstream or "<your provider's OpenAI-compatible base URL>"
        protocol = ("" if self.upstream_protocol == "openai"
                    else f" --upstream-protocol {self.upstream_protocol}")
        model = f" --model {self.model}" if self.model else ""
        token_flag = " --token <the token given to metaclaw wire>" if token else ""
        line = (f"METACLAW_UPSTREAM_API_KEY=<the provider's key> metaclaw serve --upstream "
                f"{upstream}{protocol}{model} --port {port}{token_flag}")
        if self.agent == "claude-code" and self.upstream_protocol == "anthropic":
            line += ("\n(in front of another provider's model: --upstream <its OpenAI-compatible "
                     "base URL> --model <its model>, without --upstream-protocol)")
        return line


def openclaw_config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Where OpenClaw reads its configuration (see the module docstring)."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("OPENCLAW_CONFIG_PATH"):
        return Path(os.environ["OPENCLAW_CONFIG_PATH"]).expanduser()
    state = os.environ.get("OPENCLAW_STATE_DIR")
    return (Path(state).expanduser() if state else Path.home() / ".openclaw") / "openclaw.json"


def _regular(path: Path) -> bool:
    """Whether ``path`` (through a symlink) is a file (False: missing; :class:`WireError`:
    something else, a device, a pipe or a folder, which wiring must never replace nor read)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise WireError(f"cannot read {path} ({exc.strerror}); fix it or pass --config") from None
    if not stat.S_ISREG(mode):
        raise WireError(f"{path} is not a regular file; pass --config with the agent's "
                        "configuration file")
    return True


def _read(path: Path) -> tuple[bytes | None, str, dict[str, Any]]:
    """The file's exact bytes (None when missing), its text and the object it holds."""
    if not _regular(path):
        return None, "", {}
    try:
        raw = path.read_bytes()  # bytes, not text: line endings and a BOM survive the backup
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise WireError(f"{path} is not UTF-8 text; fix the file or pass --config") from None
    except OSError as exc:
        raise WireError(f"cannot read {path} ({exc.strerror}); fix it or pass --config") from None
    try:
        config = jsontext.loads(text) if text.strip() else {}
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
    # a symlink stays a symlink: replace the file it points to
    write_atomic(path.resolve(), data, like=like, suffix=".metaclaw-tmp")


def lock_path(config_path: Path) -> Path:
    """The lock file of a config: beside the file it resolves to, so that every path to one
    file (a symlink, the target) takes the same lock."""
    target = Path(config_path).expanduser().resolve()
    return target.with_name(target.name + LOCK_SUFFIX)


@contextlib.contextmanager
def locked(config_path: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the config's lock (:func:`lock_path`) for one change, waiting at most ``timeout``
    seconds (:data:`LOCK_TIMEOUT`) for another process to release it; :class:`WireError`
    when it does not."""
    from filelock import FileLock, Timeout

    path = lock_path(config_path)
    lock = FileLock(path, timeout=LOCK_TIMEOUT if timeout is None else timeout, mode=0o600)
    try:
        lock.acquire(poll_interval=0.05)
    except Timeout:
        raise WireError(f"another `metaclaw wire` is changing {config_path} (it holds {path}); "
                        "wait for it to finish, then run the command again") from None
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held, so no one locks a file about to go
        lock.release()


def _dig(config: dict[str, Any], *keys: str, missing: Any = None) -> Any:
    """``config[k1][k2]...``, or ``missing`` where a key on the way is absent."""
    for key in keys:
        if not isinstance(config, dict) or key not in config:
            return missing
        config = config[key]
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
        raise WireError(f"{config_path} is already wired to MetaClaw (primary model "
                        f"{primary}); " + _first_undo("openclaw", config_path,
                                                   "agents.defaults.model.primary"))
    providers = _dig(config, "models", "providers") or {}
    source = providers.get(source_name) if isinstance(providers, dict) else None
    model = model or source_model
    if not model and original is None:
        raise WireError(f"there is no OpenClaw configuration at {config_path}: pass --config "
                        "PATH of the one OpenClaw reads, or --model NAME (the model the proxy "
                        "should serve) to write a new one there")
    if not model:
        raise WireError(f"{config_path} names no primary model (agents.defaults.model.primary); "
                        "pass --model NAME (the model the proxy should serve)")
    models = [dict(m) for m in (source or {}).get("models") or [] if isinstance(m, dict)]
    if not any(m.get("id") == model for m in models):
        models.append({"id": model, "name": model, "input": ["text"], "contextWindow": 128000,
                       "maxTokens": 8192})
    for entry in models:  # OpenClaw then sends its session id as prompt_cache_key on every turn
        entry["compat"] = {**(entry.get("compat") or {}), "supportsPromptCacheKey": True}
    wired, keys = json.loads(json.dumps(config)), [["models", "providers", PROVIDER]]
    wired.setdefault("models", {}).setdefault("providers", {})[PROVIDER] = {
        "baseUrl": proxy_url, "apiKey": token or "metaclaw", "api": "openai-completions",
        "headers": {"X-MetaClaw-Client": "openclaw"}, "models": models}
    if "mode" not in wired["models"]:
        wired["models"]["mode"] = "merge"  # keep OpenClaw's built-in providers
        keys.append(["models", "mode"])
    defaults = wired.setdefault("agents", {}).setdefault("defaults", {})
    if not isinstance(defaults.get("model"), dict):
        defaults["model"] = {}
        keys.append(["agents", "defaults", "model"])
    defaults["model"]["primary"] = f"{PROVIDER}/{model}"
    keys.append(["agents", "defaults", "model", "primary"])
    upstream = (source or {}).get("baseUrl")
    return WirePlan(config_path, before, _json_after(before, wired, keys),
                    upstream if isinstance(upstream, str) else None, model, primary, original)


def _first_undo(agent: str, path: Path, entry: str) -> str:
    """What to do before wiring again a file that already points at the proxy: undo the
    wiring that did it, or (none recorded: a hand edit) change that entry by hand."""
    if Path(f"{path}{STATE_SUFFIX}").exists():
        return f"run `metaclaw wire {agent} --config {path} --undo` first to re-wire"
    return (f"it was not wired by `metaclaw wire` (nothing to undo): edit {entry} by hand, or "
            "leave it as it is")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def apply(plan: WirePlan) -> None:
    """Write the wired configuration, keeping the original bytes for :func:`undo`.

    Refused (:class:`WireError`, nothing written) when the file is no longer the one the plan
    was made from: another process changed it in between, and writing the plan would lose that
    change and back up the wrong bytes.
    """
    path = plan.path
    _writable(path)
    _regular(path)
    made, folder = [], path.resolve().parent
    while not folder.exists():  # made for it: undo removes them again where left empty
        made.append(str(folder))
        folder = folder.parent
    path.resolve().parent.mkdir(parents=True, exist_ok=True)
    with locked(path):
        try:
            current = path.read_bytes() if path.exists() else None
        except OSError as exc:
            raise WireError(f"cannot read {path} ({exc.strerror}); fix it or pass --config") \
                from None
        if current != plan.original:
            raise WireError(f"{path} changed while it was being wired (another `metaclaw wire`, "
                            "or an edit); nothing was written: run the command again")
        _apply(plan, made)


def _apply(plan: WirePlan, made: list[str]) -> None:
    path = plan.path
    backup, state = Path(f"{path}{BACKUP_SUFFIX}"), Path(f"{path}{STATE_SUFFIX}")
    after = plan.after.encode("utf-8")
    try:
        if plan.original is not None:
            # the file as it is now, even if an earlier wiring left a backup: undo gives back
            # what the user had just before this wiring, edits since the earlier one included
            _write(backup, plan.original, like=path)
        _write(state, json.dumps({"written_sha256": _sha(after),
                                  "existed": plan.original is not None,
                                  "primary_before": plan.primary_before, "agent": plan.agent,
                                  "restore": plan.restore, "made_folders": made}
                                 ).encode("utf-8"))
        _write(path, after, like=path)
    except BaseException:  # (a full disk, an interrupt) not wired: nothing says it is
        for left in (state, backup):
            with contextlib.suppress(OSError):
                left.unlink(missing_ok=True)
        raise


def undo(config_path: Path) -> str:
    """Restore the configuration as it was before wiring; returns what was done."""
    state = Path(f"{config_path}{STATE_SUFFIX}")
    if not state.exists():  # checked before locking too: no lock file where nothing was wired
        raise WireError(f"{config_path} was not wired by metaclaw (no {state.name}); nothing to "
                        "undo")
    with locked(config_path):
        done, made = _undo(config_path)
    for folder in made:  # the folders wiring made for a file that was not there, if empty
        with contextlib.suppress(OSError):
            Path(folder).rmdir()
    return done


def _undo(config_path: Path) -> tuple[str, list[str]]:
    """What :func:`undo` did, and the folders to remove where empty (none unless the file
    it made was removed)."""
    backup, state = Path(f"{config_path}{BACKUP_SUFFIX}"), Path(f"{config_path}{STATE_SUFFIX}")
    if not state.exists():  # another process undid it while this one waited for the lock
        raise WireError(f"{config_path} was not wired by metaclaw (no {state.name}); nothing to "
                        "undo")
    info = json.loads(state.read_text(encoding="utf-8"))
    agent = info.get("agent") or "openclaw"
    current, text, config = (_read(config_path) if agent in ("openclaw", "claude-code",
                                                             "opencode")
                             else _read_raw(config_path))
    existed = info.get("existed")
    as_wired = current is not None and _sha(current) == info["written_sha256"]
    original = backup.read_bytes() if existed and backup.exists() else None
    made: list[str] = []
    if current is None and original is not None:  # removed since: the original comes back
        _write(config_path, original, like=backup)
        done = f"restored {config_path} exactly as it was before wiring (it had been removed)"
    elif current is None:
        done = (f"{config_path} is gone; there was none before wiring"
                if not existed else f"{config_path} is gone, and so is its backup; nothing "
                "to restore")
    elif current == original:  # the wiring never landed (cut short), or was undone by hand
        done = f"{config_path} is as it was before wiring; left as it is"
    elif as_wired and not existed:
        _writable(config_path)
        config_path.resolve().unlink()  # (through a symlink: the file wiring made, not the link)
        done = f"removed {config_path}: there was none before wiring"
        made = [str(folder) for folder in info.get("made_folders") or []]
    elif as_wired and original is not None:  # (without it, only taking back the wiring is safe)
        _writable(config_path)
        _write(config_path, original, like=config_path)
        done = f"restored {config_path} exactly as it was before wiring"
    elif agent != "openclaw":  # edited since: take back only what wiring added
        done, keep = _unwire(agent, config_path, text, info.get("restore") or {},
                             backed_up=original is not None)
        if keep:  # a key the user changed was kept: the original stays for them to compare
            state.unlink(missing_ok=True)
            return done, made
    else:  # edited since: take back only what wiring added
        providers, keys = _dig(config, "models", "providers"), []
        if isinstance(providers, dict) and providers.pop(PROVIDER, None) is not None:
            keys.append(["models", "providers", PROVIDER])
        model = _dig(config, "agents", "defaults", "model")
        if isinstance(model, dict) and str(model.get("primary", "")).startswith(f"{PROVIDER}/"):
            if info.get("primary_before"):
                model["primary"] = info["primary_before"]
            else:
                model.pop("primary")
            keys.append(["agents", "defaults", "model", "primary"])
        if keys:
            _writable(config_path)
            _write(config_path, _json_after(text, config, keys).encode("utf-8"),
                   like=config_path)
            done = (f"{config_path} changed since wiring: removed the '{PROVIDER}' provider and "
                    f"restored the primary model ({info.get('primary_before') or 'unset'}); other "
                    "edits kept")
        else:  # e.g. a wiring cut short before the file was replaced: keep it byte for byte
            done = f"{config_path} holds no MetaClaw wiring; left as it is"
    backup.unlink(missing_ok=True)
    state.unlink(missing_ok=True)
    return done, made


# -- the other agents -----------------------------------------------------------------------------
# Each plan records in ``restore`` what undoing takes back when the file was edited since wiring
# (otherwise undo restores the backup's exact bytes): for JSON and YAML files, ``keys``: each
# key path wiring set, with the value it had before (``null``: absent); for Codex's TOML, the
# ``model_provider`` line it replaced. Every plan is checked by reading the wired text back.

_ABSENT = "__metaclaw_absent__"


def _read_raw(path: Path) -> tuple[bytes | None, str, Any]:
    """The file's exact bytes (None when missing) and its text (no parsing)."""
    if not _regular(path):
        return None, "", None
    try:
        raw = path.read_bytes()
        return raw, raw.decode("utf-8-sig"), None
    except UnicodeDecodeError:
        raise WireError(f"{path} is not UTF-8 text; fix the file or pass --config") from None
    except OSError as exc:
        raise WireError(f"cannot read {path} ({exc.strerror}); fix it or pass --config") from None


def _home(env: str, *default: str) -> Path:
    value = os.environ.get(env)
    return Path(value).expanduser() if value else Path.home().joinpath(*default)


def config_path(agent: str, explicit: str | os.PathLike[str] | None = None) -> Path:
    """Where ``agent`` reads its configuration: ``--config`` when given, else OpenClaw's
    (:func:`openclaw_config_path`), ``$CODEX_HOME/config.toml`` (``~/.codex``), Claude Code's
    ``$CLAUDE_CONFIG_DIR/settings.json`` (``~/.claude``), opencode's
    ``$XDG_CONFIG_HOME/opencode/opencode.json`` or ``opencode.jsonc`` where that exists
    (``~/.config``) or ``~/.aider.conf.yml``."""
    if agent == "openclaw":
        return openclaw_config_path(explicit)
    if explicit:
        return Path(explicit).expanduser()
    return {"codex": lambda: _home("CODEX_HOME", ".codex") / "config.toml",
            "claude-code": lambda: _home("CLAUDE_CONFIG_DIR", ".claude") / "settings.json",
            "opencode": lambda: _opencode_config(_home("XDG_CONFIG_HOME", ".config") / "opencode"),
            "aider": lambda: Path.home() / ".aider.conf.yml"}[agent]()


def _opencode_config(folder: Path) -> Path:
    """opencode's global config in ``folder``: ``opencode.jsonc`` where it exists (opencode
    reads it after ``opencode.json``, so its settings win: wiring ``opencode.json`` beside it
    changed nothing), else ``opencode.json``; but ``opencode.json`` while it holds a wiring,
    so that ``--undo`` finds it."""
    json_, jsonc = folder / "opencode.json", folder / "opencode.jsonc"
    if Path(f"{json_}{STATE_SUFFIX}").exists():
        return json_
    return jsonc if jsonc.is_file() else json_


def _set(config: dict[str, Any], keys: list[str], value: Any,
         restore: list[list[Any]]) -> None:
    """Set ``config[k1][k2]... = value``, remembering the value it had and a digest of the one
    written (for undo: a value the user changed since is left as it is). The state file that
    keeps them exists only while the file it sits beside holds the wired values themselves (a
    token too), with the same owner and mode. An object made on the way (``provider`` where
    there was none) is remembered as such: undo puts back what was there once it is empty."""
    node = config
    for depth, key in enumerate(keys[:-1]):
        if not isinstance(node.get(key), dict):
            restore.append([keys[:depth + 1], node.get(key, _ABSENT), _value_sha({}), _MADE])
            node[key] = {}
        node = node[key]
    restore.append([keys, node.get(keys[-1], _ABSENT), _value_sha(value)])
    node[keys[-1]] = value


#: Marks a key of ``restore`` whose object wiring made to hold its values (see :func:`_set`).
_MADE = "made"


def _names_the_proxy(value: Any) -> bool:
    """Whether a configuration value still points at the proxy (the ``metaclaw`` provider): a
    value the user changed to another MetaClaw model is the wiring's, not theirs to keep."""
    return isinstance(value, str) and value.startswith(f"{PROVIDER}/")


def _value_sha(value: Any) -> str:
    """A digest of a configuration value (what wiring wrote)."""
    return _sha(json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8"))


def _json_text(config: dict[str, Any], like: str = "") -> str:
    """``config`` as JSON indented as the file ``like`` was (2 spaces when it says nothing), so
    that the diff shows what wiring changed rather than every line re-indented."""
    found = re.search(r"^([ \t]+)\S", like, re.M)
    indent: Any = found.group(1) if found else 2
    if isinstance(indent, str) and set(indent) == {" "}:
        indent = len(indent)
    return json.dumps(config, indent=indent, ensure_ascii=False) + "\n"


def _json_after(before: str, wired: dict[str, Any], keys: list[list[str]]) -> str:
    """The text of ``wired``: ``before`` with the values at the key paths ``keys`` made those of
    ``wired`` (removed where ``wired`` has none), edited in place so that its comments and
    layout stay (:func:`metaclaw.jsontext.set_keys`); else, where the text cannot be edited so
    or reads back as anything but ``wired``, all of ``wired`` as JSON."""
    changes = [(path, _dig(wired, *path, missing=jsontext.DELETE)) for path in keys]
    text = jsontext.set_keys(before, changes) if before.strip() else None
    if text is not None:
        try:
            if jsontext.loads(text) == wired:
                return text
        except (ValueError, RecursionError):
            pass
    return _json_text(wired, before)


_YAML_KEY = r"^{key}[ \t]*:(?P<rest>[^\n]*)(?:\n|$)"


def _yaml_comment(raw: str) -> tuple[str, str]:
    """A YAML line's text after its key's ``:``, split into the value and the comment after
    it with the space before it (``"  # main model"``; ``""`` where there is none); a ``#``
    inside quotes is the value's."""
    quote, escaped = None, False
    for i, char in enumerate(raw):
        if escaped:  # \" in double quotes
            escaped = False
        elif quote:
            escaped = quote == '"' and char == "\\"
            quote = None if char == quote else quote  # ('' in single quotes toggles twice)
        elif char in "'\"":
            quote = char
        elif char == "#" and i and raw[i - 1] in " \t":
            start = len(raw[:i].rstrip(" \t"))
            return raw[:start].strip(), raw[start:].rstrip()
    return raw.strip(), ""


def _yaml_after(before: str, wired: dict[str, Any], keys: list[list[str]]) -> str:
    """The text of ``wired`` (a YAML mapping): ``before`` with the lines of the top-level keys
    ``keys`` set to their values in ``wired`` (removed where it has none, added at the end where
    ``before`` has none), so that its comments and layout stay; else, where a key's value is
    not a one-line scalar or the text reads back as anything but ``wired``, all of ``wired``
    as YAML."""
    import yaml

    try:
        present = yaml.safe_load(before) if before.strip() else {}
    except yaml.YAMLError:
        present = None
    text = before
    for path in keys:
        if len(path) != 1:
            break
        key, value = path[0], _dig(wired, *path, missing=jsontext.DELETE)
        found = list(re.finditer(_YAML_KEY.format(key=re.escape(key)), text, re.M))
        raw = found[-1].group("rest") if found else ""
        ending = "\r\n" if raw.endswith("\r") or not found and "\r\n" in text else "\n"
        rest, comment = _yaml_comment(raw.removesuffix("\r"))
        if not found and isinstance(present, dict) and key in present:
            break  # the key written another way (quoted): not found, so not edited in place
        if len(found) > 1 or found and (not rest or rest[0] in "|>&*!{[") or found and \
                text[found[-1].end():found[-1].end() + 1] in (" ", "\t", "-"):
            break  # a block, a flow collection or a repeated key: not edited in place
        line = "" if value is jsontext.DELETE else yaml.safe_dump(
            {key: value}, sort_keys=False, allow_unicode=True, width=10_000)
        if line:  # the line's own comment stays on it, as it was spaced, and its line ending
            line = line.rstrip("\n") + comment + ending
        if found:
            text = text[:found[-1].start()] + line + text[found[-1].end():]
        elif line:
            text = (text if not text or text.endswith("\n") else text + ending) + line
    else:
        try:
            if (yaml.safe_load(text) or {}) == wired:
                return text
        except yaml.YAMLError:
            pass
    return yaml.safe_dump(wired, sort_keys=False, allow_unicode=True)


def plan_claude_code(path: Path, proxy_url: str, *, token: str | None = None,
                     model: str | None = None) -> WirePlan:
    """Claude Code reads ``env`` from its settings: ``ANTHROPIC_BASE_URL`` points it at the
    proxy's root (it speaks the Anthropic Messages API, ``/v1/messages``), and the proxy token
    goes in ``ANTHROPIC_AUTH_TOKEN`` (sent as a bearer token). Its own model choice is kept
    unless ``model`` is given (``ANTHROPIC_MODEL``)."""
    original, before, config = _read(path)
    env = config.get("env") if isinstance(config.get("env"), dict) else {}
    root = proxy_url.removesuffix("/v1")
    if env.get("ANTHROPIC_BASE_URL") == root:
        raise WireError(f"{path} is already wired to MetaClaw (env.ANTHROPIC_BASE_URL); "
                        + _first_undo("claude-code", path, "env.ANTHROPIC_BASE_URL"))
    wired, restore = json.loads(json.dumps(config)), []
    _set(wired, ["env", "ANTHROPIC_BASE_URL"], root, restore)
    if token:
        _set(wired, ["env", "ANTHROPIC_AUTH_TOKEN"], token, restore)
    if model:
        _set(wired, ["env", "ANTHROPIC_MODEL"], model, restore)
    upstream, protocol = env.get("ANTHROPIC_BASE_URL") or "https://api.anthropic.com", "anthropic"
    if model and not model.lower().startswith("claude") and "ANTHROPIC_BASE_URL" not in env:
        # another provider's model (gpt-4o-mini): Claude Code in front of an OpenAI-compatible
        # upstream, its requests translated (no Anthropic model is named so)
        upstream, protocol = "https://api.openai.com/v1", "openai"
    return WirePlan(path, before, _json_after(before, wired, [k[0] for k in restore]), upstream,
                    model or "", None, original, agent="claude-code", restore={"keys": restore},
                    upstream_protocol=protocol)


def plan_opencode(path: Path, proxy_url: str, *, token: str | None = None,
                  model: str | None = None) -> WirePlan:
    """opencode: a provider ``metaclaw`` (``@ai-sdk/openai-compatible``, the proxy's base URL
    and token) serving the model, made the default ``model`` (``metaclaw/<model>``)."""
    original, before, config = _read(path)
    current = config.get("model") if isinstance(config.get("model"), str) else ""
    provider_name, _, current_model = current.partition("/")
    if provider_name == PROVIDER:
        raise WireError(f"{path} is already wired to MetaClaw (model {current}); "
                        + _first_undo("opencode", path, "its model (and provider.metaclaw)"))
    model = model or current_model
    if not model:
        where = (f"{path} names no model (\"model\": \"provider/model\")" if original is not None
                 else f"there is no {path} yet to name a model")
        raise WireError(f"{where}; pass --model NAME (the model the proxy should serve)")
    wired, restore = json.loads(json.dumps(config)), []
    _set(wired, ["provider", PROVIDER], {
        "npm": "@ai-sdk/openai-compatible", "name": "MetaClaw",
        "options": {"baseURL": proxy_url, "apiKey": token or "metaclaw"},
        "models": {model: {"name": model}}}, restore)
    _set(wired, ["model"], f"{PROVIDER}/{model}", restore)
    source = _dig(config, "provider", provider_name, "options", "baseURL")
    return WirePlan(path, before, _json_after(before, wired, [k[0] for k in restore]),
                    source if isinstance(source, str) else None,
                    model, current or None, original, agent="opencode",
                    restore={"keys": restore})


def plan_aider(path: Path, proxy_url: str, *, token: str | None = None,
               model: str | None = None) -> WirePlan:
    """aider (``.aider.conf.yml``): ``openai-api-base`` is the proxy, ``openai-api-key`` its
    token and ``model`` ``openai/<model>`` (litellm's OpenAI-compatible route). Those keys'
    lines are edited in place (:func:`_yaml_after`: the file's comments stay, aider's sample
    file is mostly comments)."""
    import yaml

    original, before, _ = _read_raw(path)
    try:
        config = yaml.safe_load(before) if before.strip() else {}
        config = {} if config is None else config  # comments only (aider's sample file)
    except yaml.YAMLError as exc:
        raise WireError(f"cannot read {path} as YAML ({' '.join(str(exc).split())}); fix the "
                        "file or pass --config") from None
    if not isinstance(config, dict):
        raise WireError(f"{path} does not hold a YAML mapping; fix the file or pass --config")
    if config.get("openai-api-base") == proxy_url:
        raise WireError(f"{path} is already wired to MetaClaw (openai-api-base); "
                        + _first_undo("aider", path, "openai-api-base"))
    current = config.get("model") if isinstance(config.get("model"), str) else ""
    provider = current.split("/", 1)[0] if "/" in current else "openai"
    model = model or current.split("/", 1)[-1]
    if not model:
        raise WireError(f"{path} names no model; pass --model NAME (the model the proxy should "
                        "serve)")
    wired, restore = dict(config), []
    _set(wired, ["openai-api-base"], proxy_url, restore)
    _set(wired, ["openai-api-key"], token or "metaclaw", restore)
    _set(wired, ["model"], f"openai/{model}", restore)
    after = _yaml_after(before, wired, [k[0] for k in restore])
    # where the model was served: its own base URL, else its provider's (litellm's prefix)
    base = config.get("openai-api-base") if isinstance(config.get("openai-api-base"),
                                                        str) else None
    upstream, protocol = {"openai": (base or "https://api.openai.com/v1", "openai"),
                          "anthropic": ("https://api.anthropic.com", "anthropic")}.get(
        provider, (None, "openai"))
    return WirePlan(path, before, after, upstream, model, current or None, original,
                    agent="aider", restore={"keys": restore}, upstream_protocol=protocol)


_TOML_HEADER = re.compile(r"^\s*\[", re.M)
_TOML_OWN_TABLE = re.compile(
    rf"^[ \t]*\[model_providers\.{PROVIDER}\][ \t]*(?:#[^\r\n]*)?\r?$", re.M)
_TOML_PROVIDER = re.compile(r"^model_provider\s*=[^\r\n]*", re.M)


def plan_codex(path: Path, proxy_url: str, *, token: str | None = None,
               model: str | None = None) -> WirePlan:
    """Codex CLI (``config.toml``): a ``[model_providers.metaclaw]`` table (the proxy's base
    URL, ``wire_api = "responses"``, the token read from ``$METACLAW_PROXY_TOKEN`` when the
    proxy has one) made the ``model_provider``. The file is edited as text: its comments and
    layout stay as they were."""
    import tomllib

    original, before, _ = _read_raw(path)
    try:
        config = tomllib.loads(before)
    except tomllib.TOMLDecodeError as exc:
        raise WireError(f"cannot read {path} as TOML ({exc}); fix the file or pass --config") \
            from None
    providers = config.get("model_providers") if isinstance(
        config.get("model_providers"), dict) else {}
    if PROVIDER in providers:
        raise WireError(f"{path} is already wired to MetaClaw ([model_providers.{PROVIDER}]); "
                        + _first_undo("codex", path, f"[model_providers.{PROVIDER}]"))
    if re.search(r"^model_providers\s*=", before, re.M):
        raise WireError(f"{path} declares model_providers as an inline table, which TOML lets "
                        "no one extend; write each provider as a [model_providers.<name>] table, "
                        "then wire again")
    profile = config.get("profile")
    profiles = config.get("profiles") if isinstance(config.get("profiles"), dict) else {}
    chosen = profiles.get(profile) if isinstance(profile, str) else None
    if isinstance(chosen, dict) and "model_provider" in chosen:
        raise WireError(f"{path}: the active profile {profile!r} sets model_provider = "
                        f"{chosen['model_provider']!r}, which wins over the top-level one wiring "
                        f"sets; remove it from [profiles.{profile}] (or choose another profile), "
                        "then wire again")
    previous = config.get("model_provider") if isinstance(config.get("model_provider"),
                                                           str) else None
    head_end = _first_table(before)
    head, rest = before[:head_end], before[head_end:]
    line = f'model_provider = "{PROVIDER}"'
    found = _TOML_PROVIDER.search(head)
    replaced = found.group(0) if found else None
    if found:
        head = head[:found.start()] + line + head[found.end():]
    else:
        head = f"{line}\n" + head
    block = (f"\n[model_providers.{PROVIDER}]\nname = \"MetaClaw\"\n"
             f"base_url = {json.dumps(proxy_url)}\nwire_api = \"responses\"\n")
    if token:
        block += 'env_key = "METACLAW_PROXY_TOKEN"\n'
    after = head + rest
    after = (after if after.endswith("\n") or not after else after + "\n") + block
    try:  # read back: the edit must be what Codex will read
        wired = tomllib.loads(after)
    except tomllib.TOMLDecodeError as exc:
        raise WireError(f"{path} is laid out in a way this text edit cannot follow ({exc}); "
                        f"add [model_providers.{PROVIDER}] by hand (docs/how-to/wire-agents.md) "
                        "or simplify the file, then wire again") from None
    if wired.get("model_provider") != PROVIDER or PROVIDER not in wired.get("model_providers",
                                                                           {}):
        raise WireError(f"{path}: the wired file would not select the proxy; add "
                        f"[model_providers.{PROVIDER}] by hand")
    source = providers.get(previous) if previous else None
    upstream = (source or {}).get("base_url") if isinstance(source, dict) else None
    # Codex speaks the Responses API; its built-in OpenAI provider and providers it reaches with
    # wire_api = "responses" are forwarded that way (Responses-only models stay reachable)
    responses = source is None or (isinstance(source, dict)
                                   and source.get("wire_api", "responses") == "responses")
    return WirePlan(path, before, after, upstream or "https://api.openai.com/v1",
                    model or (config.get("model") if isinstance(config.get("model"), str)
                              else ""), previous, original, agent="codex",
                    restore={"line": replaced},
                    upstream_protocol="responses" if responses else "openai")


def _first_table(text: str) -> int:
    """Where the first table header of TOML ``text`` starts (its length when there is none),
    skipping lines inside multi-line strings."""
    position, inside = 0, None
    for line in text.splitlines(keepends=True):
        if inside is None and _TOML_HEADER.match(line):
            return position
        for quote in ('"""', "'''"):
            if inside in (None, quote) and line.count(quote) % 2:
                inside = quote if inside is None else None
        position += len(line)
    return len(text)


PLANS = {"openclaw": plan_openclaw, "codex": plan_codex, "claude-code": plan_claude_code,
         "opencode": plan_opencode, "aider": plan_aider}


def plan(agent: str, path: Path, proxy_url: str, *, token: str | None = None,
         model: str | None = None) -> WirePlan:
    """The wiring of ``agent``'s configuration at ``path`` to the proxy at ``proxy_url``
    (``http://host:port/v1``); nothing is written."""
    if agent != "openclaw" and Path(f"{path}{STATE_SUFFIX}").exists():
        raise WireError(f"{path} is already wired to MetaClaw; run `metaclaw wire {agent} "
                        "--undo` first to re-wire")
    return PLANS[agent](path, proxy_url, token=token, model=model)


def _unwire(agent: str, path: Path, text: str, restore: dict[str, Any], *,
            backed_up: bool = True) -> tuple[str, bool]:
    """Take back only what wiring added to ``path`` (edited since): the keys it set get the
    values they had, but for one the user changed since to a value of their own (kept);
    Codex's provider table goes and its ``model_provider`` line comes back. Returns what was
    done, and whether a key was kept (the backup is then kept too)."""
    if agent == "codex":
        header = _TOML_OWN_TABLE.search(text)  # a header line, not a comment naming it
        if header is None and not re.search(rf'^model_provider\s*=\s*"{PROVIDER}"', text, re.M):
            return f"{path} holds no MetaClaw wiring; left as it is", False
        if header is not None:
            start = header.start()
            following = _TOML_HEADER.search(text, header.end())
            end = following.start() if following else len(text)
            lines = text[start:end].splitlines(keepends=True)
            # its keys go; comments and blank lines after the last (the user's) stay
            last = max(i for i, line in enumerate(lines)
                       if line.strip() and not line.lstrip().startswith("#"))
            kept = "".join(lines[last + 1:])
            text = text[:start].rstrip("\n") + "\n" + kept.lstrip("\n") + text[end:]
        line = restore.get("line")
        text = re.sub(rf'^model_provider\s*=\s*"{PROVIDER}"[^\r\n]*(\r?\n)?',
                      lambda m: (line + (m.group(1) or "\n")) if line else "", text, count=1,
                      flags=re.M)  # (the file's own line ending)
        _writable(path)
        _write(path, text.encode("utf-8"), like=path)
        return (f"{path} changed since wiring: removed the '{PROVIDER}' provider and restored "
                f"model_provider ({line or 'unset'}); other edits kept"), False
    if agent == "aider":
        import yaml

        try:
            config = yaml.safe_load(text) if text.strip() else {}
        except yaml.YAMLError as exc:
            raise WireError(f"{path} changed since wiring and is no longer valid YAML "
                            f"({' '.join(str(exc).split())}); fix it, then run --undo again") \
                from None
    else:
        config = jsontext.loads(text) if text.strip() else {}
    if not isinstance(config, dict):
        return f"{path} holds no MetaClaw wiring; left as it is", False
    taken, left, emptied, set_back = [], [], [], []
    entries = restore.get("keys") or []
    for keys, value, *wrote in reversed(entries):
        node = config
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        current = node.get(keys[-1], _ABSENT)
        if wrote[1:] == [_MADE]:  # an object wiring made: as it was, once nothing is left in it
            if current == {}:
                if value == _ABSENT:
                    node.pop(keys[-1])
                else:
                    node[keys[-1]] = value
                emptied.append(keys)
            continue
        if wrote and (current == _ABSENT or _value_sha(current) != wrote[0]):
            if not _names_the_proxy(current):
                left.append(keys)  # the user's own value since (or removed): theirs to keep
                continue
            set_back.append(f"{'.'.join(keys)} {current}")  # still the proxy's: it goes too
        if value == _ABSENT:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
        taken.append(keys)
    keys = taken + emptied
    if agent == "claude-code" and config.get("env") == {} and all(
            len(e) < 3 for e in entries):  # (a wiring recorded before made objects were)
        config.pop("env")
        keys.append(["env"])
    data = (_yaml_after(text, config, keys) if agent == "aider"
            else _json_after(text, config, keys))
    _writable(path)
    _write(path, data.encode("utf-8"), like=path)
    kept = (f"; kept {', '.join('.'.join(k) for k in reversed(left))}, changed since ("
            + (f"the original stays in {path.name}{BACKUP_SUFFIX})" if backed_up else
               "there was no file before wiring)") if left else "")
    back = (f"; set back {', '.join(set_back)} (changed since, still the proxy's: it goes with "
            "the wiring)" if set_back else "")
    return (f"{path} changed since wiring: took back what wiring set "
            f"({', '.join('.'.join(k) for k in reversed(taken)) or 'nothing left'}){back}{kept}; "
            "other edits kept"), bool(left)
