"""The built-in benchmark agent: a tool-calling loop over the OpenAI chat API.

One :class:`DayAgent` per day: one conversation, one session (``X-Session-Id``), the day's context
files (``AGENTS.md``, ``IDENTITY.md``, ``SOUL.md``, ``TOOLS.md``, ``USER.md``) as the system prompt
(as upstream's OpenClaw agent loads them), then the day's seed conversation, then one user
message per round. Within a round the agent calls workspace tools until the model answers
without tool calls, or until ``max_iterations`` model calls. Every call goes to ``base_url``
(normally the MetaClaw proxy) through the official ``openai`` SDK; the day's last call carries
``X-Session-Done: true``.

    agent = DayAgent(AgentConfig(base_url=proxy.url, model="m"), workspace, day, session_id="day01")
    turn = await agent.ask("Please organize ...")
    await agent.finish("[Previous Feedback] ...")   # last call of the day, no tools
    await agent.aclose()
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from metaclaw.bench.data import Day
from metaclaw.bench.workspace import TOOL_NAMES, TOOL_SCHEMAS, Workspace, tool_step

SESSION_HEADER = "X-Session-Id"
DONE_HEADER = "X-Session-Done"


class AgentError(RuntimeError):
    """A model call failed (unreachable server, HTTP error); the message names what to change."""


@dataclass
class AgentConfig:
    """Where and how the agent talks to its model."""

    base_url: str
    model: str
    api_key: str | None = None          # the proxy usually needs none; "EMPTY" is sent then
    max_iterations: int = 20            # model calls per round (tool loop bound)
    timeout: float = 120.0              # seconds per model call
    max_retries: int = 1
    temperature: float | None = None
    max_tokens: int | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)


@dataclass
class AgentTurn:
    """What happened in one round: the final reply, the tool calls made, and any error."""

    reply: str
    tool_calls: list[dict] = field(default_factory=list)   # [{"name", "arguments", "result"}]
    model_calls: int = 0
    error: str | None = None
    duration_s: float = 0.0


def system_prompt(workspace: Workspace) -> str:
    """The system prompt: how to work in the workspace, then each context file as a section."""
    parts = [
        "You are a personal assistant working inside a workspace folder on the user's files.",
        "",
        "## Tooling",
        "Tools available in this session: " + ", ".join(TOOL_NAMES) + ". All paths are relative "
        "to the workspace root. Use the tools to read inputs and to create or change files; "
        "describe what you did in your final reply.",
    ]
    context = workspace.context()
    if context:
        parts += ["", "# Project Context", "",
                  "The following project context files have been loaded:"]
        for name, text in context.items():
            parts += ["", f"## {name}", "", text.strip()]
    return "\n".join(parts)


class DayAgent:
    """One day's conversation with the model, with the workspace tools."""

    def __init__(self, config: AgentConfig, workspace: Workspace, day: Day | None = None, *,
                 session_id: str, client: Any = None):
        self.config = config
        self.workspace = workspace
        self.session_id = session_id
        self.messages: list[dict] = [{"role": "system", "content": system_prompt(workspace)}]
        if day is not None:
            self.messages += [dict(m) for m in day.seed_messages]
        self._client = client
        self._own_client = client is None

    @property
    def client(self):
        if self._client is None:
            from openai import AsyncOpenAI

            self._client = AsyncOpenAI(base_url=self.config.base_url,
                                       api_key=self.config.api_key or "EMPTY",
                                       timeout=self.config.timeout,
                                       max_retries=self.config.max_retries)
        return self._client

    async def _call(self, *, tools: bool, done: bool) -> Any:
        import openai

        headers = {**self.config.extra_headers, SESSION_HEADER: self.session_id}
        if done:
            headers[DONE_HEADER] = "true"
        params: dict[str, Any] = {"model": self.config.model, "messages": self.messages,
                                  "extra_headers": headers}
        if tools:
            params["tools"] = TOOL_SCHEMAS
        if self.config.temperature is not None:
            params["temperature"] = self.config.temperature
        if self.config.max_tokens is not None:
            params["max_tokens"] = self.config.max_tokens
        try:
            response = await self.client.chat.completions.create(**params)
        except openai.APIConnectionError as exc:
            raise AgentError(f"could not reach the model at {self.config.base_url} ({exc}); start the "
                             "proxy or pass the right --upstream URL") from None
        except openai.APIStatusError as exc:
            raise AgentError(f"the model server at {self.config.base_url} answered HTTP "
                             f"{exc.status_code}: {_error_message(exc)}") from None
        except openai.APIError as exc:
            raise AgentError(f"the model call failed: {exc}") from None
        if not getattr(response, "choices", None):
            raise AgentError(f"the model server at {self.config.base_url} returned no choices")
        return response.choices[0].message

    async def ask(self, text: str, *, done: bool = False) -> AgentTurn:
        """Send a user message and run the tool loop; model errors end up in ``AgentTurn.error``.

        ``done``: mark every call of this turn as the session's last (use :meth:`finish` instead
        when a final no-tool message follows).
        """
        started = time.perf_counter()
        self.messages.append({"role": "user", "content": text})
        turn = AgentTurn(reply="")
        for _ in range(self.config.max_iterations):
            try:
                message = await self._call(tools=True, done=done)
            except AgentError as exc:
                turn.error = str(exc)
                break
            turn.model_calls += 1
            added, calls = tool_step(self.workspace, message)
            self.messages += added
            if message.content:
                turn.reply = message.content
            if not calls:
                break
            turn.tool_calls += [{"name": c["function"]["name"],
                                 "arguments": c["function"]["arguments"],
                                 "result": c["result"][:2000]} for c in calls]
        else:
            turn.error = (f"the agent made {self.config.max_iterations} model calls without a final "
                          "answer; raise max_iterations if the tasks need more tool steps")
        turn.duration_s = time.perf_counter() - started
        return turn

    async def finish(self, text: str) -> AgentTurn:
        """The day's last call: one message without tools, sent with ``X-Session-Done: true``."""
        started = time.perf_counter()
        self.messages.append({"role": "user", "content": text})
        turn = AgentTurn(reply="")
        try:
            message = await self._call(tools=False, done=True)
            turn.model_calls = 1
            turn.reply = message.content or ""
            self.messages.append({"role": "assistant", "content": turn.reply})
        except AgentError as exc:
            turn.error = str(exc)
        turn.duration_s = time.perf_counter() - started
        return turn

    async def aclose(self) -> None:
        if self._own_client and self._client is not None:
            await self._client.close()
            self._client = None


def _error_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    try:
        return json.dumps(body)[:300] if body is not None else str(exc)
    except (TypeError, ValueError):
        return str(exc)
