"""``metaclaw wire codex | claude-code | opencode | aider``: the same dry-run diff, byte-exact
undo, take-back of only the wiring after a hand edit, and refusal to wire twice as for OpenClaw
(``tests/test_wire.py``, which also covers the shared atomic write and lock); and the wired
Codex and Claude Code configurations driving the real CLIs through a proxy when installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib

import json5
import pytest
import yaml

from metaclaw import wire

CLI = [sys.executable, "-m", "metaclaw"]

CODEX = """# my Codex settings
model = "gpt-5-codex"
model_provider = "acme"   # the company gateway

[model_providers.acme]
name = "Acme"
base_url = "https://llm.acme.test/v1"
env_key = "ACME_KEY"

[profiles.fast]
model = "gpt-5-mini"
"""
CLAUDE = '{\n  "permissions": {"allow": ["Bash(ls)"]},\n  "env": {"DISABLE_TELEMETRY": "1"}\n}\n'
OPENCODE = ('{\n  // my opencode\n  "model": "acme/acme-large",\n  "provider": {"acme": '
            '{"options": {"baseURL": "https://llm.acme.test/v1"}}}\n}\n')
AIDER = "# aider settings\nmodel: gpt-4o-mini\ndark-mode: true\n"
ORIGINALS = {"codex": ("config.toml", CODEX), "claude-code": ("settings.json", CLAUDE),
             "opencode": ("opencode.json", OPENCODE), "aider": (".aider.conf.yml", AIDER)}


def run_cli(*args, env=None, check=True):
    done = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _read(agent, path):
    text = path.read_text()
    if agent == "codex":
        return tomllib.loads(text)
    if agent == "aider":
        return yaml.safe_load(text)
    import json5

    return json5.loads(text)


def test_claude_code_wired_with_another_providers_model_serves_it_from_an_openai_upstream(
        tmp_path):
    """``wire claude-code --model gpt-4o-mini`` (README's model): the serve line puts the proxy
    in front of an OpenAI-compatible upstream, not Anthropic's API with an OpenAI model name; a
    Claude model keeps the Anthropic upstream. Codex's dry run says where its token is read."""
    config = tmp_path / "settings.json"
    config.write_text("{}")
    gpt = run_cli("wire", "claude-code", "--config", config, "--model", "gpt-4o-mini",
                  "--dry-run").stdout
    assert "--upstream https://api.openai.com/v1 --model gpt-4o-mini" in gpt, gpt
    assert "--upstream-protocol" not in gpt
    claude = run_cli("wire", "claude-code", "--config", config, "--model", "claude-sonnet-4-5",
                     "--dry-run").stdout
    assert "--upstream https://api.anthropic.com --upstream-protocol anthropic" in claude
    codex = tmp_path / "config.toml"
    codex.write_text(CODEX)
    dry = run_cli("wire", "codex", "--config", codex, "--token", "tok-secret", "--dry-run").stdout
    assert "export METACLAW_PROXY_TOKEN=<the token> where Codex runs" in dry
    assert "tok-secret" not in dry


@pytest.mark.parametrize("agent", sorted(ORIGINALS))
def test_dry_run_apply_and_undo_to_the_exact_bytes(agent, tmp_path):
    name, original = ORIGINALS[agent]
    config = tmp_path / name
    config.write_text(original)
    dry = run_cli("wire", agent, "--config", config, "--port", 31000, "--token", "tok-secret",
                  "--dry-run").stdout
    assert "dry run: nothing written" in dry and "tok-secret" not in dry
    assert config.read_text() == original
    done = run_cli("wire", agent, "--config", config, "--port", 31000, "--token", "tok-secret")
    assert "Now run: METACLAW_UPSTREAM_API_KEY=" in done.stdout
    # the serve line asks for the token the agent now sends, without showing it
    assert "--token <the token given to metaclaw wire>" in done.stdout
    assert "tok-secret" not in done.stdout
    assert ("in front of another provider's model" in done.stdout) is (agent == "claude-code")
    assert "ANTHROPIC_AUTH_TOKEN=metaclaw" not in done.stdout  # the token is the key
    wired = _read(agent, config)
    if agent == "codex":
        assert wired["model_provider"] == "metaclaw"
        assert wired["model_providers"]["metaclaw"] == {
            "name": "MetaClaw", "base_url": "http://127.0.0.1:31000/v1",
            "wire_api": "responses", "env_key": "METACLAW_PROXY_TOKEN"}
        assert wired["model_providers"]["acme"]["base_url"] == "https://llm.acme.test/v1"
        assert "# my Codex settings" in config.read_text()  # edited as text: comments kept
        assert ("--upstream https://llm.acme.test/v1 --upstream-protocol responses --model "
                "gpt-5-codex") in done.stdout
    elif agent == "claude-code":
        assert wired["env"] == {"DISABLE_TELEMETRY": "1",
                                "ANTHROPIC_BASE_URL": "http://127.0.0.1:31000",
                                "ANTHROPIC_AUTH_TOKEN": "tok-secret"}
        assert "--upstream-protocol anthropic" in done.stdout
    elif agent == "opencode":
        assert wired["model"] == "metaclaw/acme-large"
        assert wired["provider"]["metaclaw"]["options"] == {
            "baseURL": "http://127.0.0.1:31000/v1", "apiKey": "tok-secret"}
        assert "--upstream https://llm.acme.test/v1 --model acme-large" in done.stdout
    else:
        assert wired == {"model": "openai/gpt-4o-mini", "dark-mode": True,
                         "openai-api-base": "http://127.0.0.1:31000/v1",
                         "openai-api-key": "tok-secret"}
    again = run_cli("wire", agent, "--config", config, check=False)
    assert again.returncode != 0 and "already" in again.stderr
    undone = run_cli("wire", agent, "--config", config, "--undo").stdout
    assert "exactly as it was" in undone and config.read_text() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.parametrize("agent", sorted(ORIGINALS))
def test_undo_after_a_hand_edit_takes_back_only_the_wiring(agent, tmp_path):
    name, original = ORIGINALS[agent]
    config = tmp_path / name
    config.write_text(original)
    run_cli("wire", agent, "--config", config, "--port", 31000)
    before_edit = _read(agent, config)
    if agent == "codex":
        config.write_text(config.read_text().replace('model = "gpt-5-mini"',
                                                     'model = "gpt-5-nano"'))
    elif agent == "aider":
        config.write_text(config.read_text() + "auto-commits: false\n")
    else:
        edited = {**before_edit, "theme": "dark"}
        config.write_text(json.dumps(edited))
    undone = run_cli("wire", agent, "--config", config, "--undo").stdout
    assert "changed since wiring" in undone
    after = _read(agent, config)
    expected = _read(agent, _write(tmp_path / f"original-{name}", original))
    if agent == "codex":
        expected["profiles"]["fast"]["model"] = "gpt-5-nano"
        assert 'model_provider = "acme"' in config.read_text()
    elif agent == "aider":
        expected["auto-commits"] = False
    else:
        expected["theme"] = "dark"
    assert after == expected


def _write(path, text):
    path.write_text(text)
    return path


def test_a_missing_config_is_created_and_undo_removes_it(tmp_path):
    (tmp_path / "home").mkdir()
    config = tmp_path / "home" / "fresh" / ".claude" / "settings.json"
    done = run_cli("wire", "claude-code", "--config", config, "--port", 31000)
    # no token wired: a Claude Code that is not logged in needs a key of some kind
    assert "export ANTHROPIC_AUTH_TOKEN=metaclaw" in done.stdout
    assert (f"there was none before: `metaclaw wire claude-code --config {config} --undo` "
            "removes it") in done.stdout  # the file given, so that the hint undoes that one
    assert json5.loads(config.read_text()) == {"env": {
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:31000"}}
    assert "there was none before" in run_cli("wire", "claude-code", "--config", config,
                                              "--undo").stdout
    # the folders made for it go with it; one that held something else stays
    assert not config.exists() and list((tmp_path / "home").iterdir()) == []
    config.parent.mkdir(parents=True)
    (config.parent / "notes.txt").write_text("mine")
    run_cli("wire", "claude-code", "--config", config, "--port", 31000)
    run_cli("wire", "claude-code", "--config", config, "--undo")
    assert not config.exists() and (config.parent / "notes.txt").read_text() == "mine"


def test_default_config_paths_follow_each_agents_own_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("CODEX_HOME", str(tmp_path / "codex"))
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "claude"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert wire.config_path("codex") == tmp_path / "codex" / "config.toml"
    assert wire.config_path("claude-code") == tmp_path / "claude" / "settings.json"
    assert wire.config_path("opencode") == tmp_path / "xdg" / "opencode" / "opencode.json"
    assert wire.config_path("aider") == tmp_path / "home" / ".aider.conf.yml"
    # opencode reads opencode.jsonc after opencode.json, so its settings win: that is the file
    # to wire (opencode.json written beside it changed nothing, and opencode failed)
    jsonc = tmp_path / "xdg" / "opencode" / "opencode.jsonc"
    jsonc.parent.mkdir(parents=True)
    jsonc.write_text('{\n // mine\n "model": "anthropic/claude-sonnet-4-5",\n}\n')
    assert wire.config_path("opencode") == jsonc
    done = run_cli("wire", "opencode", "--port", "30100", "--model", "gpt-4o-mini")
    assert str(jsonc) in done.stdout and not (jsonc.parent / "opencode.json").exists()
    assert json5.loads(jsonc.read_text())["model"] == "metaclaw/gpt-4o-mini"
    assert "// mine" in jsonc.read_text()  # edited in place: the comment stays
    run_cli("wire", "opencode", "--undo")
    assert "// mine" in jsonc.read_text()  # the file as it was
    # an opencode.json wired before a .jsonc appeared beside it is still found to be undone
    jsonc.rename(jsonc.with_suffix(".hidden"))
    run_cli("wire", "opencode", "--port", "30100", "--model", "gpt-4o-mini", "--token", "tok-1234")
    jsonc.with_suffix(".hidden").rename(jsonc)
    assert wire.config_path("opencode") == jsonc.parent / "opencode.json"
    run_cli("wire", "opencode", "--undo")
    assert not (jsonc.parent / "opencode.json").exists() and wire.config_path("opencode") == jsonc


def test_an_unreadable_config_is_refused_and_left_alone(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("model = [unclosed\n")
    done = run_cli("wire", "codex", "--config", config, check=False)
    assert done.returncode != 0 and "cannot read" in done.stderr
    assert config.read_text() == "model = [unclosed\n"


@pytest.mark.skipif(not (os.environ.get("METACLAW_CODEX") or shutil.which("codex")),
                    reason="the Codex CLI is not installed")
def test_a_wired_codex_runs_through_metaclaw_serve(tmp_path):
    """``metaclaw wire codex``, ``metaclaw serve`` (a real process, token required), then
    ``codex exec``: the turn goes through the proxy and is recorded."""
    import socket

    from metaclaw.offline.double import DoubleServer, Reply
    from metaclaw.store import Store

    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text('model = "gpt-5-codex"\n')
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_cli("wire", "codex", "--config", home / "config.toml", "--port", port,
            "--token", "tok-secret")
    db = tmp_path / "ws.db"
    with DoubleServer([Reply("wired and working")]) as upstream:
        serve = subprocess.Popen(
            [*CLI, "serve", "--upstream", upstream.url, "--port", str(port), "--db", str(db),
             "--skills", str(tmp_path / "skills"), "--starter-skills", "--token", "tok-secret"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "METACLAW_UPSTREAM_API_KEY": "upstream-key"})
        try:
            assert "MetaClaw proxy on" in serve.stdout.readline()
            done = subprocess.run(
                [os.environ.get("METACLAW_CODEX") or shutil.which("codex"), "exec",
                 "--skip-git-repo-check", "I have to change deploy/config.yaml before tonight's "
                 "release; it isn't in git. What first?"], cwd=tmp_path, capture_output=True,
                text=True, timeout=180, env={**os.environ, "CODEX_HOME": str(home),
                                             "METACLAW_PROXY_TOKEN": "tok-secret"})
        finally:
            serve.terminate()
            serve.wait(timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wired and working" in done.stdout
    with Store(db) as store:
        turns = [t for t in store.turns() if t["turn_type"] == "main"]
    assert turns and turns[0]["protocol"] == "responses" and turns[0]["status"] == "ok"
    assert "backup-before-modify" in turns[0]["injected_skills"]


@pytest.mark.parametrize("text, says", [
    ('profile = "work"\n\n[profiles.work]\nmodel_provider = "acme"\n\n[model_providers.acme]\n'
     'base_url = "https://llm.acme.test/v1"\n', "the active profile 'work' sets model_provider"),
    ('model_providers = { acme = { base_url = "https://llm.acme.test/v1" } }\n',
     "inline table"),
])
def test_codex_configs_wiring_cannot_take_over_are_refused_with_what_to_do(tmp_path, text, says):
    """A profile's own model_provider would win over the wiring (Codex would never reach the
    proxy, yet wiring said it was done); an inline model_providers table cannot be extended."""
    config = tmp_path / "config.toml"
    config.write_text(text)
    done = run_cli("wire", "codex", "--config", config, check=False)
    assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr
    assert config.read_text() == text


def test_codex_wiring_follows_multi_line_strings_and_its_provider_protocol(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('developer_instructions = """\nAlways:\n[1] run the tests\n"""\n'
                      'model_provider = "acme"\n\n[model_providers.acme]\n'
                      'base_url = "https://llm.acme.test/v1"\nwire_api = "responses"\n')
    done = run_cli("wire", "codex", "--config", config, "--port", 31000)
    wired = tomllib.loads(config.read_text())
    assert wired["model_provider"] == "metaclaw"
    assert wired["developer_instructions"] == "Always:\n[1] run the tests\n"
    assert "--upstream https://llm.acme.test/v1 --upstream-protocol responses" in done.stdout


def test_dry_run_masks_list_secrets_and_bearer_headers_and_keeps_the_indent(tmp_path):
    aider = tmp_path / ".aider.conf.yml"
    aider.write_text("model: gpt-4o\napi-key:\n  - anthropic=sk-ant-SECRET1\nset-env:\n"
                     "  - OPENROUTER_API_KEY=sk-or-SECRET2\n")
    claude = tmp_path / "settings.json"
    claude.write_text('{\n    "env": {\n        "ANTHROPIC_CUSTOM_HEADERS": '
                      '"Authorization: Bearer sk-SECRET3"\n    }\n}\n')
    shown = (run_cli("wire", "aider", "--config", aider, "--dry-run").stdout
             + run_cli("wire", "claude-code", "--config", claude, "--dry-run").stdout)
    assert "SECRET" not in shown
    run_cli("wire", "claude-code", "--config", claude)
    assert claude.read_text().startswith('{\n    "env": {\n        "ANTHROPIC_CUSTOM_HEADERS"')


def test_aider_comment_only_config_and_provider_prefixes(tmp_path):
    config = tmp_path / ".aider.conf.yml"
    config.write_text("# aider's sample settings\n# model: gpt-4o\n")
    refused = run_cli("wire", "aider", "--config", config, check=False)
    assert refused.returncode != 0 and "names no model" in refused.stderr  # read, not refused
    config.write_text("model: anthropic/claude-sonnet-4-5\n")
    done = run_cli("wire", "aider", "--config", config)
    assert "--upstream https://api.anthropic.com --upstream-protocol anthropic" in done.stdout
    assert yaml.safe_load(config.read_text())["model"] == "openai/claude-sonnet-4-5"
    config.write_text(config.read_text() + "dark-mode: [true\n")  # broken by hand
    broken = run_cli("wire", "aider", "--config", config, "--undo", check=False)
    assert broken.returncode != 0 and "no longer valid YAML" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_aider_keeps_its_comments_wired_and_undone_after_an_edit(tmp_path):
    """aider's sample settings file is mostly comments; wiring rewrote it as plain YAML."""
    config = tmp_path / ".aider.conf.yml"
    config.write_text("# aider settings\n## the model to use\n#model: gpt-4\n"
                      "model: gpt-4o-mini  # mine\ndark-mode: true\n")
    run_cli("wire", "aider", "--config", config, "--port", 30100, "--token", "tok-1")
    wired = config.read_text()
    assert wired.startswith("# aider settings\n## the model to use\n#model: gpt-4\n")
    assert "model: openai/gpt-4o-mini  # mine\n" in wired
    assert yaml.safe_load(wired)["openai-api-base"] == "http://127.0.0.1:30100/v1"
    config.write_text(wired + "# added later\nauto-commits: false\n")  # edited since
    assert "other edits kept" in run_cli("wire", "aider", "--config", config, "--undo").stdout
    assert config.read_text() == ("# aider settings\n## the model to use\n#model: gpt-4\n"
                                  "model: gpt-4o-mini  # mine\ndark-mode: true\n"
                                  "# added later\nauto-commits: false\n")


def test_aider_lines_keep_their_spacing_quotes_comments_and_crlf(tmp_path):
    """A wired line kept its comment but not the spaces before it; CRLF lines became LF while
    wired; a quoted value's comment was dropped."""
    config = tmp_path / ".aider.conf.yml"
    config.write_bytes(b'# settings\r\nmodel: "gpt-4o"   # main model, "quoted"\r\n'
                       b"dark-mode: true\r\n")
    run_cli("wire", "aider", "--config", config, "--port", 30100)
    wired = config.read_bytes()
    assert b"model: openai/gpt-4o   # main model, \"quoted\"\r\n" in wired
    assert b"\n" not in wired.replace(b"\r\n", b"") and wired.startswith(b"# settings\r\n")
    assert yaml.safe_load(wired)["openai-api-base"] == "http://127.0.0.1:30100/v1"
    config.write_bytes(wired.replace(b"dark-mode: true", b"dark-mode: false"))  # edited since
    run_cli("wire", "aider", "--config", config, "--undo")
    assert config.read_bytes() == (b'# settings\r\nmodel: gpt-4o   # main model, "quoted"\r\n'
                                   b"dark-mode: false\r\n")


def _wire(agent, config, **options):
    wire.apply(wire.plan(agent, config, "http://127.0.0.1:31000/v1", **options))


def test_undo_after_the_wired_file_was_removed_gives_back_the_original(tmp_path):
    """The backup is the only copy of the original: undo restores it, for every agent, where
    it took the file's absence for an edit (a settings file of ``{}``) and dropped the backup."""
    for agent, (name, original) in ORIGINALS.items():
        config = tmp_path / agent / name
        config.parent.mkdir()
        config.write_bytes(original.encode())
        _wire(agent, config)
        config.unlink()
        assert "it had been removed" in wire.undo(config)
        assert config.read_bytes() == original.encode(), agent
        assert sorted(p.name for p in config.parent.iterdir()) == [name]


def test_a_wiring_cut_short_leaves_no_wiring_behind(tmp_path, monkeypatch):
    """A write of the config that fails (a full disk, an interrupt) leaves no state saying the
    file is wired nor a backup; a wiring whose file holds the original bytes again (undone by
    hand) is undone by changing nothing."""
    config = _write(tmp_path / "settings.json", CLAUDE)
    real = wire._write

    def full_disk(path, data, like=None):
        if path == config:
            raise OSError(28, "No space left on device")
        real(path, data, like)
    monkeypatch.setattr(wire, "_write", full_disk)
    with pytest.raises(OSError):
        _wire("claude-code", config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.json"]
    monkeypatch.setattr(wire, "_write", real)
    _wire("claude-code", config)
    config.write_text(CLAUDE)  # the user put it back by hand
    assert "as it was before wiring; left as it is" in wire.undo(config)
    assert config.read_text() == CLAUDE and sorted(p.name for p in tmp_path.iterdir()) == [
        "settings.json"]


def test_a_dangling_symlink_keeps_its_link_through_wire_and_undo(tmp_path):
    (tmp_path / "dot").mkdir()
    link = tmp_path / "settings.json"
    link.symlink_to(tmp_path / "dot" / "settings.json")
    _wire("claude-code", link, token="T0KEN")
    assert "T0KEN" in (tmp_path / "dot" / "settings.json").read_text()
    assert "there was none before wiring" in wire.undo(link)
    assert link.is_symlink() and not (tmp_path / "dot" / "settings.json").exists()


def test_undo_after_an_edit_keeps_a_wired_key_the_user_changed(tmp_path):
    config = _write(tmp_path / "opencode.json", OPENCODE)
    _wire("opencode", config)
    wired = json5.loads(config.read_text())
    config.write_text(json.dumps({**wired, "model": "anthropic/claude-sonnet-4"}))
    done = wire.undo(config)
    assert "kept model, changed since (the original stays in opencode.json.metaclaw-backup)" \
        in done
    after = json5.loads(config.read_text())
    assert after["model"] == "anthropic/claude-sonnet-4" and "metaclaw" not in after["provider"]
    assert (tmp_path / "opencode.json.metaclaw-backup").read_text() == OPENCODE
    # a value changed to another of the proxy's models is the wiring's: taken back with it
    config.write_text(OPENCODE)
    (tmp_path / "opencode.json.metaclaw-backup").unlink()
    _wire("opencode", config)
    wired = json5.loads(config.read_text())
    config.write_text(json.dumps({**wired, "model": "metaclaw/gpt-4o-mini"}))
    done = wire.undo(config)
    assert "changed since (the original" not in done
    assert "set back model metaclaw/gpt-4o-mini (changed since, still the proxy's" in done
    assert json5.loads(config.read_text()) == json5.loads(OPENCODE)


def test_an_object_wiring_made_goes_once_empty_and_one_the_user_had_stays(tmp_path):
    """opencode's ``provider`` made by wiring is gone after an edited undo (it left an empty
    ``"provider": {}``); Claude Code's own ``"env": {}`` stays."""
    config = _write(tmp_path / "opencode.json", '{"model": "acme/x", "share": "disabled"}\n')
    _wire("opencode", config)
    wired = json5.loads(config.read_text())
    config.write_text(json.dumps({**wired, "share": "manual"}))
    wire.undo(config)
    assert json5.loads(config.read_text()) == {"model": "acme/x", "share": "manual"}
    settings = _write(tmp_path / "settings.json", '{"env": {}, "theme": "dark"}\n')
    _wire("claude-code", settings)
    settings.write_text(json.dumps({**json5.loads(settings.read_text()), "theme": "light"}))
    wire.undo(settings)
    assert json5.loads(settings.read_text()) == {"env": {}, "theme": "light"}


def test_a_key_the_user_rotated_after_wiring_is_kept_by_undo(tmp_path):
    """A key the user typed after wiring (a rotated API key, another base URL) is theirs: undo
    leaves it, the original stays in the backup, and says so; where there was no file before
    wiring, it says that instead of naming a backup."""
    config = _write(tmp_path / ".aider.conf.yml", "model: gpt-4o\nopenai-api-key: sk-OLD\n")
    _wire("aider", config, token="tok123")
    config.write_text(config.read_text().replace("tok123", "sk-NEW-rotated"))
    done = wire.undo(config)
    assert "kept openai-api-key, changed since (the original stays in" in done
    assert yaml.safe_load(config.read_text())["openai-api-key"] == "sk-NEW-rotated"
    fresh = tmp_path / "fresh" / "settings.json"
    _wire("claude-code", fresh, token="tok123", model="claude-x")
    wired = json5.loads(fresh.read_text())
    wired["env"]["ANTHROPIC_MODEL"] = "claude-mine"
    fresh.write_text(json.dumps(wired))
    assert "(there was no file before wiring)" in wire.undo(fresh)


def test_codex_undo_after_an_edit_follows_crlf_line_endings(tmp_path):
    config = tmp_path / "config.toml"
    config.write_bytes(CODEX.replace("\n", "\r\n").encode())
    _wire("codex", config)
    edited = config.read_bytes().replace(b"\n", b"\r\n").replace(b"\r\r\n", b"\r\n")
    config.write_bytes(edited.replace(b'"gpt-5-mini"', b'"gpt-5-nano"'))
    wire.undo(config)
    text = config.read_bytes()
    assert b"metaclaw" not in text and b'model_provider = "acme"' in text
    assert b"\n" not in text.replace(b"\r\n", b"")  # every line still ends with CRLF
    assert tomllib.loads(text.decode())["profiles"]["fast"]["model"] == "gpt-5-nano"


CODEX_HAND = """# an old setup by hand, kept for reference:
# [model_providers.metaclaw]
# base_url = "http://127.0.0.1:30000/v1"
approval_policy = "never"
sandbox_mode = "workspace-write"

[profiles.fast]
model = "gpt-5-mini"
"""


def test_codex_undo_after_an_edit_takes_back_its_table_only(tmp_path):
    """A comment naming the provider table is not the table; comments the user wrote after
    the wired table stay; a table the user wrote by hand is theirs (not an undo's)."""
    config = _write(tmp_path / "config.toml", CODEX_HAND)
    _wire("codex", config)
    config.write_text(config.read_text() + "# TODO: rotate keys\n\n[mcp_servers.docs]\n"
                      'command = "docs"\n')
    assert "changed since wiring" in wire.undo(config)
    text = config.read_text()
    assert text == CODEX_HAND + "# TODO: rotate keys\n\n[mcp_servers.docs]\ncommand = \"docs\"\n"
    hand = _write(tmp_path / "hand.toml", '[model_providers.metaclaw]\nbase_url = "x"\n')
    with pytest.raises(wire.WireError, match="not wired by `metaclaw wire`"):
        wire.plan("codex", hand, "http://127.0.0.1:31000/v1")


def test_only_regular_files_are_wired(tmp_path):
    """A device (``--config /dev/null``) is never replaced, a pipe never read (it blocks)."""
    with pytest.raises(wire.WireError, match="not a regular file"):
        wire.plan("claude-code", wire.Path(os.devnull), "http://127.0.0.1:31000/v1")
    assert not os.path.isfile(os.devnull)
    fifo = tmp_path / "settings.json"
    os.mkfifo(fifo)
    for agent in ("claude-code", "codex", "aider"):
        with pytest.raises(wire.WireError, match="not a regular file"):
            wire.plan(agent, fifo, "http://127.0.0.1:31000/v1", model="m")


def test_wire_brackets_an_ipv6_host_and_refuses_port_0(tmp_path):
    config = _write(tmp_path / "config.toml", CODEX)
    shown = run_cli("wire", "codex", "--config", config, "--host", "::1", "--dry-run").stdout
    assert 'base_url = "http://[::1]:30000/v1"' in shown
    refused = run_cli("wire", "codex", "--config", config, "--port", 0, check=False)
    assert refused.returncode == 2 and "--port 0" in refused.stderr


def test_an_undo_is_never_a_dry_run(tmp_path):
    """``--undo --dry-run`` undid the wiring (and the real undo then found nothing to undo)."""
    config = _write(tmp_path / "config.toml", CODEX)
    run_cli("wire", "codex", "--config", config, "--port", 31000)
    wired = config.read_bytes()
    refused = run_cli("wire", "codex", "--config", config, "--undo", "--dry-run", check=False)
    assert refused.returncode == 2 and "--dry-run previews a wiring" in refused.stderr
    assert config.read_bytes() == wired and (tmp_path / "config.toml.metaclaw-wire.json").exists()
    run_cli("wire", "codex", "--config", config, "--undo")
    assert config.read_text() == CODEX
