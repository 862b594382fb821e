"""The replay engine: a recorded turn's request sent again with another set of skills (or another
model), and the reply judged. The verification gate, the evolver's verification and experiments
(:mod:`metaclaw.fastloop.experiments`) all replay through :class:`Replayer`, so a case gives the same
result whoever runs it.

A replay takes the turn's messages as they were sent, removes the skill block the proxy
injected, and picks skills from the given set exactly as the proxy does (the query from the
last user message, the retriever, ``top_k``, ``min_score``, the context budget and the turn
type's stage filter), among the skills the turn's person and agent may see (a private skill of
another person or agent is never offered: :func:`metaclaw.skills.library.visible`, as the proxy
filters); the request keeps the turn's model (unless another is given), its tools and
its sampling settings. The reply is judged by the PRM (:class:`metaclaw.fastloop.judge.Judge`) like a
served turn.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from metaclaw.buffers import message_text
from metaclaw.fastloop.judge import Judge
from metaclaw.fastloop.llm import LLMClient, answer_error, check_url, replay_params, reply_message
from metaclaw.skills.library import Skill, visible
from metaclaw.skills.block import BUDGET_CHARS, TOP_K


@dataclass
class Replay:
    """One judged replay. ``score``: the judge's reward (None: the replay or its judging
    failed, see ``error``); ``upstream_failed``: the upstream, not the judge, failed."""

    score: float | None
    reply: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    error: str | None = None
    votes: int = 0
    vote_scores: list[Any] | None = None
    upstream_failed: bool = False
    latency_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    skills: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Replayer:
    """Replays turns through ``upstream_url`` and judges the replies with ``judge``.

    ``model``: the model every replay asks for (default: each turn's recorded model);
    ``retriever`` / ``top_k`` / ``min_score`` / ``budget_chars``: how replays pick their skills
    (as the proxy does; the retriever defaults to the proxy's default); ``timeout``: per upstream
    call, seconds.
    """

    def __init__(self, judge: Judge, upstream_url: str, model: str | None = None, *,
                 api_key: str | None = None, api_key_env: str = "METACLAW_UPSTREAM_API_KEY",
                 retriever: Any = None, top_k: int = TOP_K, min_score: float | None = None,
                 budget_chars: int = BUDGET_CHARS, timeout: float = 120.0):
        check_url("upstream_url", upstream_url)
        self.judge = judge
        self.upstream_url = upstream_url
        self.model = model
        self.retriever = retriever
        self.top_k, self.min_score, self.budget_chars = top_k, min_score, budget_chars
        self.timeout = float(timeout)
        self.upstream = LLMClient(upstream_url, api_key or os.environ.get(api_key_env),
                                  self.timeout)

    def settings(self) -> dict[str, Any]:
        """What decides a replay's reply and verdict, for an experiment to pin: the judge's
        model, votes and pass threshold, the model asked for, and how skills are picked."""
        retriever = self._retriever()
        model_id = getattr(retriever, "model_id", None)
        return {"judge_model": self.judge.model, "votes": self.judge.votes,
                "threshold": self.judge.threshold, "model": self.model,
                "retrieval": f"{retriever.kind}" + (f" ({model_id})" if model_id else ""),
                "top_k": self.top_k, "min_score": self.min_score,
                "budget_chars": self.budget_chars}

    def _retriever(self) -> Any:
        if self.retriever is None:
            from metaclaw.skills.retrieval import make_retriever

            self.retriever = make_retriever("auto")
        return self.retriever

    def select(self, turn: dict[str, Any], skills: list[Skill]) -> tuple[list[dict[str, Any]],
                                                                         list[str]]:
        """The messages a replay of ``turn`` sends with ``skills`` (its own skill block
        removed, the skills the proxy would pick injected), and the names of those skills.
        Only the skills the turn's person and agent may see take part (scopes)."""
        from metaclaw.skills.retrieval import select_and_inject

        skills = visible(list(skills), turn.get("person"), turn.get("agent"))
        done = select_and_inject(self._retriever(), turn.get("request_messages") or [], skills,
                                 turn_type=turn.get("turn_type"), top_k=self.top_k,
                                 min_score=self.min_score, budget_chars=self.budget_chars)
        return done.messages, [s.skill.name for s in done.selected]

    async def areplay(self, turn: dict[str, Any], skills: list[Skill], *,
                      model: str | None = None, upstream: LLMClient | None = None,
                      semaphore: asyncio.Semaphore | None = None) -> Replay:
        """Replay ``turn`` with ``skills`` and judge the reply. ``model`` / ``upstream``: this
        replay's model and client, instead of the replayer's; ``semaphore`` bounds concurrent
        upstream calls. Never raises for a failed call: the :class:`Replay` says what failed."""
        messages, names = await asyncio.to_thread(self.select, turn, skills)
        params = replay_params(turn, messages, model or self.model)
        client = upstream or self.upstream
        started = time.perf_counter()
        try:
            if semaphore is None:
                response = await asyncio.wait_for(client.chat(params), self.timeout)
            else:
                async with semaphore:
                    response = await asyncio.wait_for(client.chat(params), self.timeout)
            refusal = answer_error(response)
            if refusal is not None:  # an upstream failure, not an empty reply to judge
                raise ValueError(f"the upstream answered 200 without a reply ({refusal})")
            message = reply_message(response)
        except asyncio.TimeoutError:
            return Replay(None, error=f"upstream timed out ({self.timeout:g} s)",
                          upstream_failed=True, skills=names)
        except Exception as exc:  # noqa: BLE001 - reported on the case, never raised
            return Replay(None, error=f"upstream failed: {client.explain(exc)}",
                          upstream_failed=True, skills=names)
        latency = (time.perf_counter() - started) * 1e3
        usage = response.get("usage") if isinstance(response, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        content = message_text(message.get("content"))
        tool_calls = message.get("tool_calls") or None
        replayed = {"request_messages": messages, "response": content,
                    "tool_calls": tool_calls, "status": "ok"}
        verdict = await self.judge.ajudge(replayed)
        return Replay(verdict.score, content, tool_calls, verdict.error, len(verdict.votes),
                      [v.get("score") for v in verdict.votes], False, latency,
                      usage.get("prompt_tokens"),
                      usage.get("completion_tokens"), names)

    async def aclose(self) -> None:
        await self.upstream.aclose()
