"""The options of ``metaclaw serve`` and ``%metaclaw start`` are declared once, on
:class:`metaclaw.runtime.RuntimeConfig`'s fields, and both parsers are built from them."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

import pytest

from metaclaw import cli
from metaclaw.notebook.magics import MagicUsageError, _start_parser
from metaclaw.proxy.app import ProxyConfig
from metaclaw.runtime import RuntimeConfig, options


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings
            if not isinstance(action, argparse._HelpAction)
            and action.dest not in ("verbose", "quiet")}  # the CLI's common -v / -q


def _declared() -> set[str]:
    flags = {f.metadata["option"]["flag"] for f, _ in options()}
    # a switch that defaults on is also given as --no-<flag>
    return flags | {"--no-" + f.metadata["option"]["flag"][2:] for f, _ in options()
                    if f.metadata["option"].get("action") is argparse.BooleanOptionalAction}


def test_the_cli_and_the_magics_accept_the_same_serve_options_as_declared():
    declared = _declared()
    assert len(declared) > 25 and "--top-k" in declared and "--no-durable-acks" in declared
    assert _flags(_serve_parser()) == declared
    assert _flags(_start_parser()) == declared


def test_every_option_reaches_its_field_through_both_parsers(monkeypatch):
    monkeypatch.delenv("METACLAW_PROXY_TOKEN", raising=False)
    values = {"--upstream": "http://up.example/v1", "--model": "m", "--host": "0.0.0.0",
              "--port": "8123", "--skills": "sk", "--db": "w.db", "--token": "t0ken",
              "--retrieval": "lexical", "--embedding-model": "static", "--top-k": "5",
              "--min-score": "0.25", "--budget-chars": "900", "--timeout": "7.5",
              "--upstream-retries": "4",
              "--upstream-protocol": "anthropic", "--context-window": "4096",
              "--max-output-tokens": "8000", "--max-body-bytes": "1048576",
              "--local-model": "some/folder", "--judge-url": "http://j.example",
              "--judge-model": "jm", "--evolver-url": "http://e.example",
              "--evolver-model": "em", "--votes": "2", "--user": "alice",
              "--agent": "codex-1", "--skill-scope": "shared", "--feedback-wait": "45"}
    switches = ["--caller-auth", "--no-durable-acks", "--fsync-acks", "--starter-skills",
                "--sim", "--auto-evolve", "--no-auto-keys"]
    argv = [word for flag, value in values.items() for word in (flag, value)] + switches
    from_cli = RuntimeConfig.from_args(cli.build_parser().parse_args(["serve", *argv]))
    from_magics = RuntimeConfig.from_args(_start_parser().parse_args(argv))
    assert from_cli == from_magics
    defaults = RuntimeConfig()
    unchanged = {f.name for f in fields(RuntimeConfig)
                 if getattr(from_cli, f.name) == getattr(defaults, f.name)}
    assert unchanged == {"api_key_env"}  # the one field that is no option
    assert (from_cli.upstream_url, from_cli.port, from_cli.top_k, from_cli.durable_acks,
            from_cli.simulated, from_cli.local_model) == ("http://up.example/v1", 8123, 5,
                                                          False, True, "some/folder")


def test_the_defaults_differ_only_where_declared(monkeypatch):
    monkeypatch.setenv("METACLAW_PROXY_TOKEN", "from-env")
    served = RuntimeConfig.from_args(cli.build_parser().parse_args(["serve"]))
    started = RuntimeConfig.from_args(_start_parser().parse_args([]))
    assert served.port == 30000 and started.port == 0  # the magics: any free port
    assert served.token == started.token == "from-env"
    # agents retry on their own, so serve relays an upstream 429/5xx at once (each of their
    # attempts would cost three upstream calls); the notebook's chat client does not retry
    assert served.max_retries == 0 and started.max_retries == 2
    library = RuntimeConfig()
    for config in (served, started):
        config.port, config.token = library.port, library.token
        config.max_retries = library.max_retries
        assert config == library


def test_a_bad_value_is_refused_by_both():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--top-k", "0"])
    with pytest.raises(MagicUsageError, match="--top-k"):
        _start_parser().parse_args(["--top-k", "0"])


def _default(field: Any) -> Any:
    return field.default_factory() if field.default is MISSING else field.default


def test_the_proxy_config_declares_the_runtime_configs_fields_alike():
    # ProxyConfig (the request path) cannot import RuntimeConfig (an outer layer), so the fields
    # both declare are written twice: they must keep one default and one type
    runtime = {f.name: f for f in fields(RuntimeConfig)}
    proxy = {f.name: f for f in fields(ProxyConfig)}
    both = sorted(set(runtime) & set(proxy))
    assert {"upstream_url", "port", "top_k", "durable_acks", "upstream_protocol"} <= set(both)
    drifted = [f"{name}: RuntimeConfig {_default(runtime[name])!r} ({runtime[name].type}), "
               f"ProxyConfig {_default(proxy[name])!r} ({proxy[name].type})" for name in both
               if (_default(runtime[name]), runtime[name].type)
               != (_default(proxy[name]), proxy[name].type)]
    assert drifted == [], "fields whose default or type differ between the two: " + \
        "; ".join(drifted)


def test_the_fast_loop_waits_for_the_users_reaction_as_configured(tmp_path):
    """A person answers an agent after reading its work, often minutes later: a turn was judged
    "no reaction" after 30 s and never again, so a correction sent at 50 s was lost. The wait
    is 600 s by default and set by --feedback-wait."""
    from metaclaw.fastloop.loop import FastLoop
    from metaclaw.runtime import Runtime

    assert RuntimeConfig().feedback_wait == 600.0
    assert FastLoop.__init__.__kwdefaults__["feedback_wait"] == 600.0
    runtime = Runtime.start(RuntimeConfig(simulated=True, feedback_wait=45.0,
                                          db_path=str(tmp_path / "w.db"),
                                          skills_dir=str(tmp_path / "skills")))
    try:
        assert runtime.fast_loop.feedback_wait == 45.0
    finally:
        runtime.stop()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--feedback-wait", "-1"])
