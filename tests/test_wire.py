"""`metaclaw wire openclaw`: dry run, apply, undo; and a real OpenClaw turn through `metaclaw
serve` (runs when the `openclaw` CLI from npm and Node >= 22 are installed)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import json5
import pytest

from metaclaw.offline.double import DoubleServer, Reply
from metaclaw.store import Store
from test_cli import CLI, free_port, run_cli, wait_for_port, write_skill

ORIGINAL = """// my OpenClaw config (JSON5: comments and trailing commas)
{
  models: {
    providers: {
      acme: {baseUrl: "https://llm.acme.test/v1", apiKey: "sk-acme", api: "openai-completions",
             models: [{id: "acme-large", name: "Acme large", contextWindow: 64000}],},
    },
  },
  agents: {defaults: {model: {primary: "acme/acme-large"}, workspace: "~/ws"}},
}
"""


def test_wire_dry_run_apply_and_undo(tmp_path):
    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL)
    dry = run_cli("wire", "openclaw", "--config", config, "--port", 31000, "--dry-run").stdout
    assert 'primary: "metaclaw/acme-large"' in dry and "dry run: nothing written" in dry
    assert "--upstream https://llm.acme.test/v1 --model acme-large --port 31000" in dry
    assert config.read_text() == ORIGINAL

    out = run_cli("wire", "openclaw", "--config", config, "--port", 31000, "--token", "tok").stdout
    wired = json5.loads(config.read_text())
    assert config.read_text().startswith("// my OpenClaw config")  # edited in place
    provider = wired["models"]["providers"]["metaclaw"]
    assert provider["baseUrl"] == "http://127.0.0.1:31000/v1" and provider["apiKey"] == "tok"
    assert provider["models"][0]["id"] == "acme-large" and provider["api"] == "openai-completions"
    assert provider["models"][0]["compat"] == {"supportsPromptCacheKey": True}
    assert wired["agents"]["defaults"]["model"]["primary"] == "metaclaw/acme-large"
    assert wired["models"]["providers"]["acme"]["apiKey"] == "sk-acme"  # untouched
    assert "Now run:" in out
    again = run_cli("wire", "openclaw", "--config", config, check=False)
    assert again.returncode == 2 and "already wired" in again.stderr

    run_cli("wire", "openclaw", "--config", config, "--undo")
    assert config.read_text() == ORIGINAL  # byte for byte, comments included

    # edited after wiring: undo takes back only what wiring added
    run_cli("wire", "openclaw", "--config", config)
    edited = json5.loads(config.read_text())
    edited["agents"]["defaults"]["workspace"] = "~/elsewhere"
    config.write_text(json.dumps(edited))
    assert "other edits kept" in run_cli("wire", "openclaw", "--config", config, "--undo").stdout
    final = json5.loads(config.read_text())
    assert "metaclaw" not in final["models"]["providers"]
    assert final["agents"]["defaults"] == {"model": {"primary": "acme/acme-large"},
                                           "workspace": "~/elsewhere"}
    missing = run_cli("wire", "openclaw", "--config", config, "--undo", check=False)
    assert missing.returncode == 2 and "not wired" in missing.stderr



def _wire(config, *args, check=True):
    return run_cli("wire", "openclaw", "--config", config, *args, check=check)


def test_wire_keeps_a_symlinked_config_a_symlink_and_private(tmp_path):
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    real = dotfiles / "openclaw.json"
    real.write_text(ORIGINAL)
    real.chmod(0o600)  # it holds API keys
    config = tmp_path / "openclaw.json"
    config.symlink_to(real)
    _wire(config, "--token", "tok")
    assert config.is_symlink() and "metaclaw" in json5.loads(real.read_text())["models"]["providers"]
    assert real.stat().st_mode & 0o777 == 0o600
    for kept in tmp_path.glob("openclaw.json.metaclaw-*"):  # the backup holds the same keys
        assert kept.stat().st_mode & 0o077 == 0, kept
    _wire(config, "--undo")
    assert config.is_symlink() and real.read_text() == ORIGINAL
    assert real.stat().st_mode & 0o777 == 0o600


def test_dry_run_shows_no_token_or_api_key(tmp_path):
    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL.replace('"sk-acme"', "'sk-acme'"))  # JSON5 quotes too
    out = _wire(config, "--token", "proxy-secret-123", "--dry-run").stdout
    assert "proxy-secret-123" not in out and "sk-acme" not in out
    assert '"apiKey": "***"' in out and "apiKey: '***'" in out


def test_round_trip_keeps_the_exact_bytes(tmp_path):
    config = tmp_path / "openclaw.json"
    original = b"\xef\xbb\xbf" + ORIGINAL.replace("\n", "\r\n").encode()  # BOM, CRLF (Windows)
    config.write_bytes(original)
    _wire(config)
    _wire(config, "--undo")
    assert config.read_bytes() == original


def test_a_config_that_is_not_utf8_is_refused_and_left_alone(tmp_path):
    config = tmp_path / "openclaw.json"
    config.write_bytes(b"{models: {}} // caf\xe9\n")
    failed = _wire(config, check=False)
    assert failed.returncode == 2 and "not UTF-8" in failed.stderr
    assert config.read_bytes() == b"{models: {}} // caf\xe9\n"


def test_a_read_only_config_is_not_replaced(tmp_path):
    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL)
    config.chmod(0o444)
    failed = _wire(config, check=False)
    assert failed.returncode == 2 and "read-only" in failed.stderr
    assert config.read_text() == ORIGINAL and config.stat().st_mode & 0o777 == 0o444


def test_undo_without_the_backup_takes_back_only_the_wiring(tmp_path):
    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL)
    _wire(config)
    (tmp_path / "openclaw.json.metaclaw-backup").unlink()  # e.g. cleaned up by hand
    _wire(config, "--undo")
    final = json5.loads(config.read_text())
    assert "metaclaw" not in final["models"]["providers"]
    assert final["agents"]["defaults"]["model"]["primary"] == "acme/acme-large"


def test_undo_leaves_a_file_without_wiring_byte_for_byte(tmp_path):
    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL)
    _wire(config)
    config.write_text(ORIGINAL)  # as if the wiring was cut short before the file was replaced
    assert "left as it is" in _wire(config, "--undo").stdout
    assert config.read_text() == ORIGINAL  # JSON5 comments kept


def test_a_missing_openclaw_config_is_said_missing(tmp_path):
    config = tmp_path / ".openclaw" / "openclaw.json"
    proc = _wire(config, "--dry-run", check=False)
    assert proc.returncode == 2 and "there is no OpenClaw configuration at" in proc.stderr
    assert "--model NAME" in proc.stderr and not config.parent.exists()
    assert _wire(config, "--model", "m").returncode == 0  # written new, with the model given
    assert json5.loads(config.read_text())["agents"]["defaults"]["model"]["primary"] \
        == "metaclaw/m"


def test_undo_keeps_an_empty_config_file(tmp_path):
    config = tmp_path / "openclaw.json"
    config.write_text("")
    _wire(config, "--model", "m")
    _wire(config, "--undo")
    assert config.exists() and config.read_text() == ""


def test_rewiring_after_a_hand_edit_undoes_to_the_edited_file(tmp_path):
    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL)
    _wire(config)
    edited = json5.loads(config.read_text())
    edited["agents"]["defaults"]["model"]["primary"] = "acme/acme-large"  # unwired by hand
    edited["agents"]["defaults"]["workspace"] = "~/elsewhere"
    config.write_text(json.dumps(edited))
    _wire(config)
    _wire(config, "--undo")
    assert json5.loads(config.read_text()) == edited


def test_a_failed_replace_leaves_the_config_and_no_temporary_file(tmp_path, monkeypatch):
    from metaclaw import wire

    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL)
    plan = wire.plan_openclaw(config, "http://127.0.0.1:30000/v1")

    def crash(src, dst):
        if os.fspath(dst) == os.fspath(config):
            raise OSError("disk full")
        return real_replace(src, dst)

    real_replace = os.replace
    monkeypatch.setattr(wire.os, "replace", crash)
    with pytest.raises(OSError):
        wire.apply(plan)
    assert config.read_text() == ORIGINAL
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]  # no stray copy of the keys


def test_plain_json_is_read_without_the_json5_parser(tmp_path, monkeypatch):
    import json5

    from metaclaw import wire

    config = tmp_path / "openclaw.json"
    config.write_text(json.dumps({"agents": {"defaults": {"model": {"primary": "a/m"}}}}))

    def slow(text):
        raise AssertionError("json5 is slow on big files; plain JSON needs no JSON5 parser")

    monkeypatch.setattr(json5, "loads", slow)
    assert wire.plan_openclaw(config, "http://127.0.0.1:30000/v1").model == "m"


# -- two `metaclaw wire` processes at once -------------------------------------------------------
# A process that holds the config's lock until its stdin is closed, like a `metaclaw wire` busy
# writing; it says "held" once it has the lock.
HOLDER = """
import sys
from metaclaw import wire
with wire.locked(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""
# What `metaclaw wire openclaw --port P` does, with a line between its two steps: it plans from
# the file as it reads it, then applies (under the lock).
WIRER = """
import sys
from metaclaw import wire
plan = wire.plan_openclaw(wire.Path(sys.argv[1]), "http://127.0.0.1:%s/v1" % sys.argv[2])
print("planned", flush=True)
try:
    wire.apply(plan)
except wire.WireError as exc:
    print(exc, file=sys.stderr)
    sys.exit(2)
"""


def _python(code, *args, stdin=None):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _hold_lock(path):
    holder = _python(HOLDER, path, stdin=subprocess.PIPE)
    assert holder.stdout.readline() == "held\n", holder.stderr.read()
    return holder


def _release(holder):
    holder.stdin.close()
    assert holder.wait(timeout=60) == 0


def test_two_wirings_at_once_take_turns_and_the_second_is_refused(tmp_path):
    """Both plan from the original file while a third process holds the lock; once it is
    released, one writes and the other, finding the file changed, writes nothing: the file,
    its record and its backup are all the winner's, and undo gives back the original."""
    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL)
    holder = _hold_lock(config)
    racers = {port: _python(WIRER, config, port) for port in (31001, 31002)}
    for racer in racers.values():
        assert racer.stdout.readline() == "planned\n", racer.stderr.read()
    _release(holder)
    codes = {port: racer.wait(timeout=60) for port, racer in racers.items()}
    assert sorted(codes.values()) == [0, 2], codes
    winner = next(port for port, code in codes.items() if code == 0)
    loser = racers[next(port for port, code in codes.items() if code == 2)]
    assert "changed while it was being wired" in loser.stderr.read()
    provider = json5.loads(config.read_text())["models"]["providers"]["metaclaw"]
    assert provider["baseUrl"] == f"http://127.0.0.1:{winner}/v1"
    assert (tmp_path / "openclaw.json.metaclaw-backup").read_text() == ORIGINAL
    record = json.loads((tmp_path / "openclaw.json.metaclaw-wire.json").read_text())
    assert record["written_sha256"] == hashlib.sha256(config.read_bytes()).hexdigest()
    _wire(config, "--undo")
    assert config.read_text() == ORIGINAL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["openclaw.json"]  # no lock file left


def test_two_undos_at_once_restore_once(tmp_path):
    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL)
    _wire(config, "--token", "tok")
    holder = _hold_lock(config)
    undos = [subprocess.Popen([*CLI, "wire", "openclaw", "--config", str(config), "--undo"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    time.sleep(0.5)  # let both reach the lock (either order gives the same end)
    _release(holder)
    results = [(u.wait(timeout=60), u.stdout.read() + u.stderr.read()) for u in undos]
    assert sorted(code for code, _ in results) == [0, 2], results
    assert any("restored" in out for _, out in results)
    assert any("nothing to undo" in out for _, out in results)
    assert config.read_text() == ORIGINAL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["openclaw.json"]


def test_a_lock_held_too_long_is_a_clear_error_and_nothing_is_written(tmp_path, monkeypatch):
    from metaclaw import wire

    config = tmp_path / "openclaw.json"
    config.write_text(ORIGINAL)
    plan = wire.plan_openclaw(config, "http://127.0.0.1:30000/v1", token="proxy-secret-123")
    monkeypatch.setattr(wire, "LOCK_TIMEOUT", 0.3)
    holder = _hold_lock(config)
    try:
        assert wire.lock_path(config).read_bytes() == b""  # no key ever lands in it
        with pytest.raises(wire.WireError, match="another `metaclaw wire` is changing"):
            wire.apply(plan)
    finally:
        _release(holder)
    assert config.read_text() == ORIGINAL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["openclaw.json"]


def test_a_symlinked_config_is_locked_by_the_file_it_points_to(tmp_path, monkeypatch):
    from metaclaw import wire

    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    real = dotfiles / "openclaw.json"
    real.write_text(ORIGINAL)
    link = tmp_path / "openclaw.json"
    link.symlink_to(real)
    assert wire.lock_path(link) == dotfiles / "openclaw.json.metaclaw.lock"
    monkeypatch.setattr(wire, "LOCK_TIMEOUT", 0.3)
    holder = _hold_lock(real)  # another process, through the other path
    try:
        with pytest.raises(wire.WireError, match="another `metaclaw wire`"):
            wire.apply(wire.plan_openclaw(link, "http://127.0.0.1:30000/v1"))
    finally:
        _release(holder)
    wire.apply(wire.plan_openclaw(link, "http://127.0.0.1:30000/v1"))
    assert link.is_symlink() and "metaclaw" in json5.loads(real.read_text())["models"]["providers"]
    assert not wire.lock_path(link).exists()


def _openclaw() -> str | None:
    binary = shutil.which("openclaw")
    node = shutil.which("node")
    if not binary or not node:
        return None
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    return binary if version.startswith("v") and int(version[1:].split(".")[0]) >= 24 else None


@pytest.mark.skipif(_openclaw() is None, reason="the OpenClaw CLI (npm `openclaw`) with Node >= 24 "
                                                "is not installed; .ci/run installs both")
def test_a_real_openclaw_turn_through_metaclaw_serve(tmp_path):
    home, workspace = tmp_path / "home", tmp_path / "workspace"
    home.mkdir()
    workspace.mkdir()
    (workspace / "notes.txt").write_text("buy milk\n")
    skills = tmp_path / "skills"
    write_skill(skills, "rename-files-safely", "Rename or move files in the workspace without "
                "overwriting existing ones.", "Check the target name is free before renaming.")
    write_skill(skills, "calendar-invites", "Create calendar invites with a time zone.", "...")
    write_skill(skills, "git-commit-messages", "Write conventional commit messages.", "...")
    db, port = tmp_path / "ws.db", free_port()
    config = home / "openclaw.json"
    env = {**os.environ, "HOME": str(home), "OPENCLAW_HOME": str(home),
           "OPENCLAW_STATE_DIR": str(home / "state"), "OPENCLAW_CONFIG_PATH": str(config)}
    with DoubleServer(lambda body: Reply("Renamed it.")) as upstream:
        config.write_text(json.dumps({
            "models": {"providers": {"local": {
                "baseUrl": upstream.url, "apiKey": "sk-local", "api": "openai-completions",
                "models": [{"id": "double-model", "name": "double", "input": ["text"],
                            "contextWindow": 32000, "maxTokens": 1024}]}}},
            "agents": {"defaults": {"model": {"primary": "local/double-model"},
                                    "workspace": str(workspace), "timeoutSeconds": 120}}}))
        run_cli("wire", "openclaw", "--port", port, env=env)
        serve = subprocess.Popen([str(a) for a in [
            *CLI, "serve", "--upstream", upstream.url, "--model", "double-model", "--port", port,
            "--skills", skills, "--db", db, "--retrieval", "lexical", "--top-k", "1"]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_port(serve, port)
            agent = subprocess.run(
                [_openclaw(), "agent", "--local", "--json", "--message",
                 "Rename notes.txt to notes-2026.txt in my workspace"],
                capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
            assert agent.returncode == 0, agent.stderr[-2000:]
            store = Store(db)
            deadline = __import__("time").time() + 20
            while not store.turns() and __import__("time").time() < deadline:
                __import__("time").sleep(0.1)
        finally:
            serve.terminate()
            serve.wait(timeout=20)
    turns = store.turns("turn_type = 'main'")
    assert turns, "OpenClaw's turn did not reach the proxy"
    turn = turns[0]
    assert turn["identified_by"]["session"] == "body:prompt_cache_key"  # OpenClaw's own session
    assert len(turn["session_id"]) >= 32 and turn["session_id"] != "default"
    assert turn["retrieval_query"] == "Rename notes.txt to notes-2026.txt in my workspace"
    assert turn["injected_skills"] == ["rename-files-safely"]
    system = upstream.requests[-1]["body"]["messages"][0]["content"]
    assert "rename-files-safely" in system and "OpenClaw" in system
    listed = [json.loads(line) for line in run_cli("turns", "--db", db, "--json").stdout.splitlines()]
    assert any(t["session_id"] == turn["session_id"] for t in listed)  # the notebook/CLI views


# -- the one atomic write of the package (metaclaw.fileio), which wire uses ---------------------
def test_the_atomic_write_leaves_the_old_file_or_the_whole_new_one(tmp_path):
    from metaclaw.fileio import atomic_folder, atomic_write, write_atomic

    target = tmp_path / "deep" / "config.json"
    write_atomic(target, "old\n")  # the folder is made
    with pytest.raises(RuntimeError):
        with atomic_write(target, "w") as out:
            out.write("half of the new")
            raise RuntimeError("the writer failed")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["config.json"]  # no temp left
    write_atomic(target, b"new", durable=True)
    assert target.read_bytes() == b"new" and os.stat(target).st_mode & 0o777 == 0o600

    shown = tmp_path / "shown.json"
    shown.write_text("{}")
    os.chmod(shown, 0o640)
    write_atomic(target, "like", like=shown)
    assert os.stat(target).st_mode & 0o777 == 0o640

    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(link.resolve(), "through the link")
    assert link.is_symlink() and target.read_text() == "through the link"

    folder = tmp_path / "model"
    with atomic_folder(folder) as staging:
        (staging / "weights").write_text("w")
    assert (folder / "weights").read_text() == "w"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_atomic_write_can_give_the_mode_open_gives_and_a_folder_its_own_hidden_name(tmp_path):
    from metaclaw.fileio import atomic_folder, write_atomic

    old_umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "shared.jsonl", "a\n", private=False)  # as open(path, "w") would
        (tmp_path / "plain.jsonl").write_text("a\n")
    finally:
        os.umask(old_umask)
    assert os.stat(tmp_path / "shared.jsonl").st_mode & 0o777 == \
        os.stat(tmp_path / "plain.jsonl").st_mode & 0o777 == 0o644
    with pytest.raises(RuntimeError):
        with atomic_folder(tmp_path / "skill", prefix=".skill.copy-") as staging:
            assert staging.name.startswith(".skill.copy-") and staging.parent == tmp_path
            raise RuntimeError("the filler failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.jsonl", "shared.jsonl"]
