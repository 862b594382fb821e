"""Training backends: one interface, two implementations (Tinker in the cloud, local torch + peft).

A backend owns a LoRA policy. It samples completions with per-token logprobs, accumulates
gradients of a named policy-gradient loss over a batch of :class:`Datum`, steps the optimizer,
publishes the current weights for sampling (a new policy version), and saves / restores its
training state. The GRPO loop (:mod:`metaclaw.slowloop.grpo`) and the serving responder
(:mod:`metaclaw.slowloop.policy`) only talk to this interface.

The datum format is Tinker's (shifted next-token alignment)::

    full_T1        = prompt_tokens + completion_tokens            (length T + 1)
    model_input_T  = full_T1[:-1]                                 (what the model reads)
    target_T       = full_T1[1:]                                  (the token predicted at t)
    logprobs_T     = 0 on prompt positions, the sampling logprob of each completion token
    advantages_T   = 0 on prompt positions, the sample's advantage on completion tokens
    mask_T         = 0 on prompt positions, 1 on completion tokens

Losses (all summed over tokens, Tinker's convention; ``ratio = exp(logp - sampling_logp)``):

- ``importance_sampling``: ``-(ratio * A).sum()``
- ``ppo``:   ``-min(ratio * A, clip(ratio, clip_low, clip_high) * A).sum()``  (0.8 / 1.2 default)
- ``cispo``: ``-(sg(clip(ratio, clip_low, clip_high)) * logp * A).sum()``

Make a backend with :func:`make_backend`::

    backend = make_backend("local", "/path/to/hf-model", lora_rank=8)
    backend = make_backend("tinker", "Qwen/Qwen3-4B-Instruct-2507", lora_rank=32)

May import: the shared modules and :mod:`metaclaw.slowloop.causal_lm` (loading a model). Never
the rest of the slow loop (GRPO, the policy server and the scheduler use the backends, not the
other way round) nor a wing above it (checked by ``tests/test_architecture.py``).
"""

from __future__ import annotations

from typing import Any

from metaclaw.slowloop.backends.base import (DEFAULT_CLIP_HIGH, DEFAULT_CLIP_LOW, LOSS_FNS, BackendError, Datum,
                                             Sample, Sampler, TokenizerMixin, TrainingBackend, check_loss_fn,
                                             locate_checkpoint, normalize_messages, render_request)


def make_backend(kind: str, base_model: str, **cfg: Any) -> TrainingBackend:
    """Create a backend.

    In: ``kind`` = ``"local"`` (``base_model`` is a local Hugging Face model path) or
    ``"tinker"`` (``base_model`` is a Tinker model id), plus backend options (``lora_rank``,
    ``seed``, ...; see :class:`metaclaw.slowloop.backends.local.LocalBackend` and
    :class:`metaclaw.slowloop.backends.tinker.TinkerBackend`). Out: a :class:`TrainingBackend`.
    """
    if kind == "local":
        from metaclaw.slowloop.backends.local import LocalBackend

        return LocalBackend(base_model, **cfg)
    if kind == "tinker":
        from metaclaw.slowloop.backends.tinker import TinkerBackend

        return TinkerBackend(base_model, **cfg)
    raise BackendError(f"unknown backend {kind!r}; use --backend local or --backend tinker")


__all__ = ["BackendError", "Datum", "LOSS_FNS", "Sample", "Sampler", "TokenizerMixin", "TrainingBackend",
           "check_loss_fn", "locate_checkpoint", "make_backend", "normalize_messages", "render_request", "DEFAULT_CLIP_LOW",
           "DEFAULT_CLIP_HIGH"]
