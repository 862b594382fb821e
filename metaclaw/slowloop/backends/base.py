"""The training backends' interface: the data a step trains on, the sampler and the backend protocols,
and the chat-template rendering shared by serving and training (:func:`render_request`).

Implemented by :mod:`~metaclaw.slowloop.backends.local` and :mod:`~metaclaw.slowloop.backends.tinker`;
made by :func:`metaclaw.slowloop.backends.make_backend`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

LOSS_FNS = ("importance_sampling", "ppo", "cispo")
DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2


class BackendError(RuntimeError):
    """A backend cannot be created or used; the message says what to change."""


@dataclass(frozen=True)
class Datum:
    """One training sequence in the shifted next-token format described in the module docstring.

    All five lists have the same length T. Build one with :meth:`from_sample`.
    """

    model_input: list[int]
    target_tokens: list[int]
    logprobs: list[float]
    advantages: list[float]
    mask: list[float]

    def __post_init__(self) -> None:
        n = len(self.model_input)
        lengths = {len(self.target_tokens), len(self.logprobs), len(self.advantages),
                   len(self.mask)}
        if lengths != {n} or n == 0:
            raise ValueError(
                "a Datum needs model_input, target_tokens, logprobs, advantages and mask of one "
                f"non-zero length; got {n} and {sorted(lengths)}")

    @classmethod
    def from_sample(cls, prompt_tokens: Sequence[int], completion_tokens: Sequence[int],
                    completion_logprobs: Sequence[float], advantage: float) -> "Datum":
        """Datum for one sampled completion: exactly the sampled tokens and their sampling
        logprobs (no re-tokenization, no padding of logprobs); prompt positions masked.

        In: prompt tokens (P >= 1), completion tokens (C >= 1) with C logprobs, the advantage.
        Out: a Datum of length T = P + C - 1.
        """
        if len(completion_tokens) != len(completion_logprobs):
            raise ValueError(
                f"{len(completion_tokens)} completion tokens but {len(completion_logprobs)} "
                "logprobs; pass the sampler's own logprobs, one per sampled token")
        if not prompt_tokens or not completion_tokens:
            raise ValueError("a Datum needs at least one prompt token and one completion token")
        full = list(prompt_tokens) + list(completion_tokens)
        n_prompt_targets = len(prompt_tokens) - 1
        n_completion = len(completion_tokens)
        return cls(
            model_input=full[:-1],
            target_tokens=full[1:],
            logprobs=[0.0] * n_prompt_targets + [float(x) for x in completion_logprobs],
            advantages=[0.0] * n_prompt_targets + [float(advantage)] * n_completion,
            mask=[0.0] * n_prompt_targets + [1.0] * n_completion,
        )

    @property
    def n_completion_tokens(self) -> int:
        return int(sum(self.mask))


@dataclass
class Sample:
    """One sampled completion: its tokens and the sampling logprob of each token."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str = "length"

    def __iter__(self):  # allows ``tokens, logprobs = sample``
        yield self.tokens
        yield self.logprobs


@runtime_checkable
class Sampler(Protocol):
    """Published, frozen weights that can be sampled from (thread-safe).

    ``policy_version`` is the version these weights were published as.
    """

    policy_version: int

    def sample(self, prompt_tokens: list[int], n: int = 1, max_tokens: int = 64,
               temperature: float = 1.0, seed: int | None = None) -> list[Sample]: ...


@runtime_checkable
class TrainingBackend(Protocol):
    """What the GRPO loop and the serving responder need from a backend."""

    kind: str
    base_model: str
    policy_version: int

    # -- tokenizer ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]: ...
    def decode(self, tokens: Sequence[int]) -> str: ...
    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]: ...
    @property
    def eos_token_id(self) -> int | None: ...

    # -- sampling -------------------------------------------------------------------------
    def sample(self, prompt_tokens: list[int], n: int = 1, max_tokens: int = 64,
               temperature: float = 1.0, seed: int | None = None) -> list[Sample]: ...
    def sampler(self) -> Sampler: ...

    # -- training -------------------------------------------------------------------------
    def forward_backward(self, datums: list[Datum],
                         loss_fn: str = "importance_sampling") -> dict[str, float]: ...
    def optim_step(self, learning_rate: float) -> dict[str, float]: ...
    def train_step(self, datums: list[Datum], loss_fn: str,
                   learning_rate: float) -> dict[str, float]: ...
    def publish(self, version: int | None = None) -> int: ...
    def save_state(self, path: str) -> str: ...
    def load_state(self, path: str) -> None: ...


def locate_checkpoint(checkpoint: str, state_dir: "str | os.PathLike[str] | None",
                      version: int | None = None) -> str:
    """Where a recorded checkpoint is now: as recorded, or, where that path is gone (the
    workspace's folder was moved or copied: the store keeps the path the trainer saw), the
    folder of that name in ``state_dir``, if it holds policy ``version`` (where given: another
    machine's folder of the same name is another state). A remote state (``tinker://``) is as
    recorded."""
    import json

    path = Path(checkpoint)
    if "://" in str(checkpoint) or path.exists() or state_dir is None:
        return checkpoint
    moved = Path(state_dir) / path.name
    if not moved.exists():
        return checkpoint
    if version is not None:
        try:
            saved = json.loads((moved / "metaclaw_state.json").read_text())
        except (OSError, ValueError):
            return checkpoint
        if not isinstance(saved, dict) or saved.get("policy_version") != version:
            return checkpoint
    return str(moved)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> plain ``{"role", "content"}`` dicts a chat template can render.

    Content-part lists are joined into text; an assistant message's ``tool_calls`` are written
    as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the format
    :mod:`metaclaw.slowloop.policy` parses back); ``None`` content becomes ``""``.
    """
    import json

    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"message {i} must be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(str(part.get("text", "")) for part in content
                               if isinstance(part, dict))
        text = "" if content is None else str(content)
        for call in message.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                pass
            text += ("" if not text else " ") + "<tool_call>" + json.dumps(
                {"name": fn.get("name", ""), "arguments": args}) + "</tool_call>"
        out.append({"role": str(message["role"]), "content": text})
    return out


def render_request(backend: Any, request: dict[str, Any]) -> list[int]:
    """The prompt tokens of a chat request: the one rendering used to serve it and to train on it.

    In: a backend (its tokenizer's chat template) and a request: an OpenAI chat body
    (``messages``, optional ``tools``) or a recorded turn (``request_messages`` and
    ``request_params.tools``, as the proxy records what it sent). Out: the token ids the
    serving policy reads, tools rendered into the chat template, generation prompt appended.
    """
    if "request_messages" in request:
        messages = request["request_messages"]
        tools = (request.get("request_params") or {}).get("tools")
    else:
        messages, tools = request.get("messages"), request.get("tools")
    return backend.render_chat(messages, tools=tools or None)


def check_loss_fn(loss_fn: str) -> str:
    if loss_fn not in LOSS_FNS:
        raise ValueError(f"unknown loss {loss_fn!r}; choose one of {', '.join(LOSS_FNS)}")
    return loss_fn


class TokenizerMixin:
    """Encode, decode and chat-template with a Hugging Face tokenizer (``self.tokenizer``);
    shared by the backends so both render prompts identically."""

    tokenizer: Any

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def reward_text(self, tokens: Sequence[int]) -> str:
        """A sampled completion as its reward sees it: every token, special ones included, less
        the final end-of-sequence token. Hiding special tokens (as :meth:`decode` does for
        display) would let the policy be rewarded for emitting, say, a new role header before
        the answer: the text would read the same while the tokens trained on do not."""
        tokens = list(tokens)
        if tokens and tokens[-1] == self.eos_token_id:
            tokens.pop()
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt tokens for a chat (the model's chat template, generation prompt appended)."""
        ids = self.tokenizer.apply_chat_template(normalize_messages(messages), tools=tools,
                                                 tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)
        return list(ids)
