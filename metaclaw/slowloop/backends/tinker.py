"""The Tinker training backend: LoRA training and sampling in the cloud with the official SDK.

Uses the ``tinker`` 0.38 futures API: every call returns a future that is resolved with
``.result()`` (no deprecated ``*_async`` methods, no client-creation futures used as clients)::

    service  = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=M, rank=R).result()
    sampler  = training.save_weights_and_get_sampling_client().result()
    sampler.sample(prompt=ModelInput, num_samples=G, sampling_params=SamplingParams)  # x P,
                                                      # all submitted, then each .result()
    fb = training.forward_backward([tinker.types.Datum, ...], "importance_sampling")
    opt = training.optim_step(tinker.types.AdamParams(learning_rate=lr))  # submitted before
    fb.result(); opt.result()                                             # waiting on fb
    training.save_state(name).result().path            # tinker://... checkpoint
    service.create_training_client_from_state_with_optimizer(path).result()   # resume

Before the first SDK call, :func:`preflight` checks within a few seconds that the service
answers at all, so an unreachable service is one clear error instead of a five-minute hang.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from metaclaw.slowloop.backends.base import (DEFAULT_CLIP_HIGH, DEFAULT_CLIP_LOW, BackendError, Datum,
    Sample, TokenizerMixin, check_loss_fn)


def preflight(base_url: str | None = None, timeout: float = 3.0) -> str:
    """Check that the Tinker service answers HTTP within ``timeout`` seconds.

    In: an optional base URL (default: ``$TINKER_BASE_URL``, else the SDK's production URL).
    Out: the URL checked. Raises :class:`BackendError` with one sentence naming what to change
    when it is unreachable. Any HTTP answer (even an error status) counts as reachable.
    """
    import httpx
    from tinker.lib.base_url import resolve_base_url

    url = resolve_base_url(base_url)
    try:
        httpx.get(f"{url}/api/v1/healthz", timeout=timeout)
    except httpx.HTTPError as exc:
        raise BackendError(
            f"cannot reach the Tinker service at {url} within {timeout:g} s "
            f"({type(exc).__name__}); check the network or TINKER_BASE_URL, or train with "
            "--backend local") from None
    return url


def to_tinker_datum(datum: Datum):
    """Convert a :class:`~metaclaw.slowloop.backends.Datum` into a real ``tinker.types.Datum``.

    ``model_input`` becomes a ``ModelInput``; ``target_tokens`` (int64), ``logprobs`` and
    ``advantages`` (float32) become ``TensorData`` of shape (T,). The mask is expressed as it is
    on Tinker, by zero advantages on masked positions (Tinker's RL losses take no mask).
    """
    from tinker import types

    n = len(datum.model_input)
    advantages = [a if m else 0.0 for a, m in zip(datum.advantages, datum.mask)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(datum.model_input)),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=list(datum.target_tokens), dtype="int64",
                                              shape=[n]),
            "logprobs": types.TensorData(data=list(datum.logprobs), dtype="float32", shape=[n]),
            "advantages": types.TensorData(data=advantages, dtype="float32", shape=[n]),
        })


class TinkerSampler:
    """A published Tinker sampling client (fixed weights) with its policy version."""

    def __init__(self, client, policy_version: int, path: str | None = None):
        self.client = client
        self.policy_version = policy_version
        self.path = path

    def _submit(self, prompt_tokens: list[int], n: int, max_tokens: int, temperature: float,
                seed: int | None):
        from tinker import types

        if not prompt_tokens:
            raise ValueError("cannot sample from an empty prompt; pass at least one token")
        return self.client.sample(
            prompt=types.ModelInput.from_ints(list(prompt_tokens)), num_samples=n,
            sampling_params=types.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                 seed=seed))

    @staticmethod
    def _samples(response) -> list[Sample]:
        out = []
        for seq in response.sequences:
            logprobs = seq.logprobs
            if logprobs is None or len(logprobs) != len(seq.tokens):
                raise BackendError("the Tinker sampler returned no per-token logprobs; GRPO "
                                   "needs them (upgrade the tinker SDK)")
            out.append(Sample(list(seq.tokens), [float(x) for x in logprobs],
                              str(seq.stop_reason)))
        return out

    def sample(self, prompt_tokens: list[int], n: int = 1, max_tokens: int = 64,
               temperature: float = 1.0, seed: int | None = None) -> list[Sample]:
        return self._samples(self._submit(prompt_tokens, n, max_tokens, temperature,
                                          seed).result())

    def sample_many(self, prompts_tokens: list[list[int]], n: int, max_tokens: int = 64,
                    temperature: float = 1.0,
                    seeds: list[int | None] | None = None) -> list[list[Sample]]:
        """Sample a group for each prompt, all requests in flight at once (one round trip)."""
        seeds = seeds or [None] * len(prompts_tokens)
        futures = [self._submit(p, n, max_tokens, temperature, s)
                   for p, s in zip(prompts_tokens, seeds)]
        return [self._samples(f.result()) for f in futures]


class TinkerBackend(TokenizerMixin):
    """GRPO training through Tinker.

    In: ``base_model`` (a Tinker model id, e.g. ``"Qwen/Qwen3-4B-Instruct-2507"``),
    ``lora_rank`` (default 32), ``seed``, ``clip_low`` / ``clip_high`` (ppo / cispo),
    ``grad_clip_norm``, ``resume_from`` (a ``tinker://`` state path: weights and optimizer),
    ``sampler_checkpoints`` (publish through named, durable sampler weights whose path is
    recorded, instead of ephemeral ones), ``ttl_seconds`` for saved checkpoints, ``base_url`` /
    ``api_key`` (default: the SDK's environment variables), ``preflight_timeout``.
    ``service_client`` and ``tokenizer`` may be passed in (an existing client, or an offline
    tokenizer); by default they come from the SDK.
    """

    kind = "tinker"

    def __init__(self, base_model: str, *, lora_rank: int = 32, seed: int | None = None,
                 clip_low: float = DEFAULT_CLIP_LOW, clip_high: float = DEFAULT_CLIP_HIGH,
                 grad_clip_norm: float = 0.0, resume_from: str | None = None,
                 sampler_checkpoints: bool = False, ttl_seconds: int | None = None,
                 base_url: str | None = None, api_key: str | None = None,
                 preflight_timeout: float = 3.0, service_client: Any = None,
                 tokenizer: Any = None):
        import tinker

        if lora_rank < 1:
            raise BackendError(f"lora_rank must be a positive integer, got {lora_rank}")
        self.base_model = base_model
        self.lora_rank = lora_rank
        self.clip_low, self.clip_high = clip_low, clip_high
        self.grad_clip_norm = grad_clip_norm
        self.sampler_checkpoints = sampler_checkpoints
        self.ttl_seconds = ttl_seconds
        if resume_from:
            self._check_path(resume_from)
        try:  # the service's refusals (no key, a wrong one, a model it does not serve): a
            # sentence, not the SDK's traceback
            if service_client is None:
                preflight(base_url, preflight_timeout)
                service_client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
            self.service = service_client
            if resume_from:
                self.training = self.service.create_training_client_from_state_with_optimizer(
                    resume_from).result()
            else:
                self.training = self.service.create_lora_training_client(
                    base_model=base_model, rank=lora_rank, seed=seed).result()
        except tinker.TinkerError as exc:
            said = " ".join(str(exc).split())[:300]
            hint = ("; set TINKER_API_KEY (or pass api_key)" if "api_key" in said.lower()
                    else "")
            raise BackendError(f"Tinker refused to start training {base_model!r}: {said}"
                               f"{hint}") from None
        self.tokenizer = tokenizer if tokenizer is not None else self.training.get_tokenizer()
        self.policy_version = 0
        self.steps = 0
        self.last_sampler_path: str | None = None
        self._sampler = self._publish_sampler(0)

    # -- sampling -------------------------------------------------------------------------
    def _publish_sampler(self, version: int) -> TinkerSampler:
        if self.sampler_checkpoints:
            saved = self.training.save_weights_for_sampler(
                f"policy-{version:06d}", ttl_seconds=self.ttl_seconds).result()
            client = self.training.create_sampling_client(saved.path).result()
            self.last_sampler_path = saved.path
            return TinkerSampler(client, version, saved.path)
        client = self.training.save_weights_and_get_sampling_client().result()
        self.last_sampler_path = None
        return TinkerSampler(client, version)

    def sampler(self) -> TinkerSampler:
        return self._sampler

    def sample(self, prompt_tokens: list[int], n: int = 1, max_tokens: int = 64,
               temperature: float = 1.0, seed: int | None = None) -> list[Sample]:
        return self._sampler.sample(prompt_tokens, n, max_tokens, temperature, seed)

    # -- training -------------------------------------------------------------------------
    def _submit_forward_backward(self, datums: list[Datum], loss_fn: str):
        check_loss_fn(loss_fn)
        if not datums:
            raise ValueError("forward_backward needs at least one Datum")
        config = (None if loss_fn == "importance_sampling" else
                  {"clip_low_threshold": self.clip_low, "clip_high_threshold": self.clip_high})
        return self.training.forward_backward([to_tinker_datum(d) for d in datums], loss_fn,
                                              config)

    def _submit_optim_step(self, learning_rate: float):
        from tinker import types

        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be positive, got {learning_rate}")
        return self.training.optim_step(types.AdamParams(
            learning_rate=learning_rate, beta1=0.9, beta2=0.95, eps=1e-8,
            grad_clip_norm=self.grad_clip_norm))

    @staticmethod
    def _forward_backward_metrics(datums: list[Datum], output) -> dict[str, float]:
        """Tinker's metrics plus ``loss`` (= ``loss:sum``), ``tokens``, and, from the learner
        logprobs Tinker returns, ``ratio_mean`` and ``kl_sample_train`` over completion tokens."""
        metrics = {k: float(v) for k, v in (output.metrics or {}).items()}
        tokens = sum(d.n_completion_tokens for d in datums)
        ratio_sum = kl_sum = 0.0
        for datum, out in zip(datums, output.loss_fn_outputs):
            learner = out.get("logprobs") if isinstance(out, dict) else None
            if learner is None:
                continue
            for lp, sp, m in zip(learner.tolist(), datum.logprobs, datum.mask):
                if m:
                    ratio_sum += math.exp(lp - sp)
                    kl_sum += sp - lp
        metrics.update({"loss": metrics.get("loss:sum", float("nan")), "tokens": tokens,
                        "datums": len(datums)})
        if tokens:
            metrics.update({"ratio_mean": ratio_sum / tokens, "kl_sample_train": kl_sum / tokens})
        return metrics

    def forward_backward(self, datums: list[Datum],
                         loss_fn: str = "importance_sampling") -> dict[str, float]:
        """Send the batch with the named loss and wait; returns metrics incl. ``loss``."""
        output = self._submit_forward_backward(datums, loss_fn).result()
        return self._forward_backward_metrics(datums, output)

    def optim_step(self, learning_rate: float) -> dict[str, float]:
        response = self._submit_optim_step(learning_rate).result()
        self.steps += 1
        return {**{k: float(v) for k, v in (response.metrics or {}).items()},
                "learning_rate": learning_rate}

    def train_step(self, datums: list[Datum], loss_fn: str,
                   learning_rate: float) -> dict[str, float]:
        """forward_backward + optim_step, both submitted before waiting (one round trip less)."""
        fb_future = self._submit_forward_backward(datums, loss_fn)
        optim_future = self._submit_optim_step(learning_rate)
        metrics = self._forward_backward_metrics(datums, fb_future.result())
        response = optim_future.result()
        self.steps += 1
        metrics.update({k: float(v) for k, v in (response.metrics or {}).items()})
        metrics["learning_rate"] = learning_rate
        return metrics

    def publish(self, version: int | None = None) -> int:
        """Save the current weights for sampling; later samples use them. Returns the version."""
        version = self.policy_version + 1 if version is None else int(version)
        self._sampler = self._publish_sampler(version)
        self.policy_version = version
        return version

    # -- state ----------------------------------------------------------------------------
    @staticmethod
    def _check_path(path: str) -> None:
        if not str(path).startswith("tinker://"):
            raise BackendError(f"{path!r} is not a Tinker checkpoint; pass the tinker://... "
                               "path returned by save_state")

    def save_state(self, path: str) -> str:
        """Save weights and optimizer state on Tinker under the name ``basename(path)``;
        returns the ``tinker://`` path to resume from."""
        response = self.training.save_state(
            Path(path).name, ttl_seconds=self.ttl_seconds,
            user_metadata={"policy_version": str(self.policy_version),
                           "steps": str(self.steps)}).result()
        return response.path

    def load_state(self, path: str) -> None:
        """Resume from a ``tinker://`` state: a new training client with the saved weights and
        optimizer state, and its weights published for sampling."""
        self._check_path(path)
        self.training = self.service.create_training_client_from_state_with_optimizer(
            path).result()
        self._sampler = self._publish_sampler(self.policy_version)
