"""The local training backend: transformers + peft LoRA on any local Hugging Face causal LM.

Same datum format and same losses as Tinker (see :mod:`metaclaw.slowloop.backends`), implemented in torch.
Training weights and sampling weights are separate objects, as on Tinker: :meth:`publish` makes a
frozen, merged copy of the current LoRA weights (a :class:`LocalSampler`) and every later sample
comes from it, while training keeps mutating the LoRA copy. A responder holding an older sampler
keeps serving from it until it swaps, so sampling never waits for training.

Hardware: ``device`` is ``auto`` | ``cpu`` | ``cuda`` | ``mps`` (auto picks a GPU when there is one)
and ``dtype`` ``auto`` (bfloat16 on a GPU that supports it, float32 elsewhere). Every tensor, and
the sampling random generator, lives on the model's device. Training runs in micro-batches of
``micro_batch_size`` sequences with gradient accumulation (the loss is a sum over tokens, so the
accumulated gradient equals the whole batch's), and the learner's log-probabilities are computed
in chunks of ``logprob_chunk`` completion tokens through the output layer, recomputed in the
backward pass: the full-vocabulary fp32 logits of a whole batch never exist at once.

Memory: each published sampler is a full copy of the model (merged LoRA). That is nothing for the
tiny offline model and fine for small models; for large models prefer the Tinker backend.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Iterator, Sequence

from metaclaw.slowloop.backends.base import (DEFAULT_CLIP_HIGH, DEFAULT_CLIP_LOW, BackendError, Datum,
    Sample, TokenizerMixin, check_loss_fn)


def policy_loss(loss_fn: str, logprobs_B_T, sampling_logprobs_B_T, advantages_B_T, mask_B_T,
                clip_low: float = DEFAULT_CLIP_LOW, clip_high: float = DEFAULT_CLIP_HIGH):
    """The policy-gradient loss, summed over unmasked tokens (Tinker's convention).

    In: tensors of shape (B, T): the learner's logprobs of the target tokens (with grad), the
    sampling logprobs, the advantages, and the mask (1 = completion token, 0 = prompt or pad).
    Out: ``(loss, stats)`` with ``loss`` a scalar tensor and ``stats`` a dict of floats
    (``ratio_mean``, ``clip_fraction``, ``kl_sample_train``), means over unmasked tokens.
    """
    import torch

    check_loss_fn(loss_fn)
    mask = mask_B_T.to(logprobs_B_T.dtype)
    ratio = torch.exp(logprobs_B_T - sampling_logprobs_B_T) * mask
    adv = advantages_B_T * mask
    if loss_fn == "importance_sampling":
        objective = ratio * adv
    elif loss_fn == "ppo":
        clipped = torch.clamp(ratio, clip_low, clip_high)
        objective = torch.minimum(ratio * adv, clipped * adv)
    else:  # cispo
        clipped = torch.clamp(ratio, clip_low, clip_high).detach()
        objective = clipped * logprobs_B_T * adv
    loss = -(objective * mask).sum()
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        clipped_tokens = ((ratio < clip_low) | (ratio > clip_high)).to(mask.dtype) * mask
        stats = {
            "ratio_mean": float((ratio * mask).sum() / n),
            "clip_fraction": float(clipped_tokens.sum() / n),
            "kl_sample_train": float(((sampling_logprobs_B_T - logprobs_B_T) * mask).sum() / n),
        }
    return loss, stats


def _cache_keyword(model) -> str:
    """The keyword under which ``model.forward`` takes the KV cache, and the name of the output
    field that returns it: ``cache`` in transformers releases that renamed it, otherwise
    ``past_key_values``.

    Asked of the model's own signature rather than of the transformers version: the rename is
    made per model class (a remote-code model keeps the forward it was written with), and a
    release that renamed it still takes the old name but warns about it on every decoding
    step. A forward that names neither (one taking only ``**kwargs``) gets the old name, which
    every release understands.
    """
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward whose signature cannot be read
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _iter_tokens(model, prompt_tokens: Sequence[int], n: int, max_tokens: int,
                 temperature: float, eos_token_id: int | None,
                 generator, cache_kw: str | None = None
                 ) -> Iterator[tuple[list[int], list[float]]]:
    """Autoregressive sampling with a KV cache; yields (tokens_N, logprobs_N) per step.

    Logprobs are those of the distribution actually sampled from (logits / temperature);
    with ``temperature == 0`` the argmax is taken and its temperature-1 logprob reported.
    Stops when every sequence has emitted ``eos_token_id`` or after ``max_tokens`` steps.
    ``cache_kw`` is :func:`_cache_keyword` of ``model`` (looked up here when not given).
    """
    import torch

    cache_kw = cache_kw or _cache_keyword(model)
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_tokens)] * n, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    with torch.inference_mode():
        out = model(input_ids=input_ids, use_cache=True)
        for _ in range(max_tokens):
            logits = out.logits[:, -1, :].float()
            if temperature > 0:
                logp = torch.log_softmax(logits / temperature, dim=-1)
                tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
            else:
                logp = torch.log_softmax(logits, dim=-1)
                tok = logp.argmax(dim=-1)
            lp = logp.gather(1, tok[:, None]).squeeze(1)
            yield tok.tolist(), lp.tolist()
            if eos_token_id is not None:
                done |= tok == eos_token_id
            if bool(done.all()):
                return
            out = model(input_ids=tok[:, None], use_cache=True,
                        **{cache_kw: getattr(out, cache_kw)})


def _generator(seed: int | None, device="cpu"):
    """A random generator on ``device`` (torch.multinomial needs it on the probabilities' device)."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else seed)
    return gen


class LocalSampler:
    """Frozen, published weights of a :class:`LocalBackend` (thread-safe for sampling)."""

    def __init__(self, model, eos_token_id: int | None, policy_version: int):
        self.model = model
        self.eos_token_id = eos_token_id
        self.policy_version = policy_version
        self.device = next(model.parameters()).device
        self.cache_kw = _cache_keyword(model)  # read once: every decoding step passes the cache

    def sample(self, prompt_tokens: list[int], n: int = 1, max_tokens: int = 64,
               temperature: float = 1.0, seed: int | None = None) -> list[Sample]:
        """``n`` completions of ``prompt_tokens``; each keeps its tokens up to and including
        the end-of-sequence token (if emitted) and the sampling logprob of each token."""
        if not prompt_tokens:
            raise ValueError("cannot sample from an empty prompt; pass at least one token")
        samples = [Sample([], []) for _ in range(n)]
        finished = [False] * n
        for toks, lps in _iter_tokens(self.model, prompt_tokens, n, max_tokens, temperature,
                                      self.eos_token_id, _generator(seed, self.device),
                                      self.cache_kw):
            for i in range(n):
                if finished[i]:
                    continue
                samples[i].tokens.append(toks[i])
                samples[i].logprobs.append(lps[i])
                if toks[i] == self.eos_token_id:
                    finished[i] = True
                    samples[i].stop_reason = "stop"
        return samples

    def stream(self, prompt_tokens: list[int], max_tokens: int = 64, temperature: float = 1.0,
               seed: int | None = None) -> Iterator[tuple[int, float]]:
        """One completion, yielded token by token as ``(token, logprob)`` (ends after EOS)."""
        for toks, lps in _iter_tokens(self.model, prompt_tokens, 1, max_tokens, temperature,
                                      self.eos_token_id, _generator(seed, self.device),
                                      self.cache_kw):
            yield toks[0], lps[0]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def read_state(path: str | os.PathLike[str]) -> dict:
    """The metadata of a :meth:`LocalBackend.save_state` directory (``backend``, ``base_model``,
    ``lora_rank``, ``policy_version``, ``steps``); BackendError when it is not one."""
    meta_file = Path(path) / "metaclaw_state.json"
    if not meta_file.is_file():
        raise BackendError(f"{str(path)!r} is not a saved training state (no metaclaw_state.json)")
    try:
        return json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise BackendError(f"cannot read {str(meta_file)!r}: {exc}") from None


def merged_policy(base_model, state_dir: str | os.PathLike[str]):
    """The policy a saved state publishes: a frozen copy of ``base_model`` (an untouched base
    causal LM, as :func:`metaclaw.slowloop.causal_lm.load_causal_lm` returns it) with the state's LoRA
    adapter merged in, on the base model's device and dtype. ``base_model`` is not modified.
    Raises BackendError (one sentence naming the path) when the state is missing or broken."""
    from peft import PeftModel

    read_state(state_dir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adapted = PeftModel.from_pretrained(copy.deepcopy(base_model), str(state_dir),
                                                is_trainable=False)
            frozen = adapted.merge_and_unload()
    except Exception as exc:  # a truncated or foreign adapter file: the caller keeps serving
        raise BackendError(f"cannot load the LoRA adapter saved in {str(state_dir)!r} "
                           f"({type(exc).__name__}: {exc})") from None
    frozen.eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    return frozen


class LocalBackend(TokenizerMixin):
    """LoRA training of a local Hugging Face causal LM with torch.

    In: ``base_model`` (a directory loadable by ``AutoModelForCausalLM``, a ``.gguf`` file, or
    ``"smollm2"`` / None for the packaged SmolLM2-135M-Instruct, see :mod:`metaclaw.slowloop.causal_lm`),
    ``lora_rank``, ``lora_alpha`` (default 2 x rank), ``seed`` (LoRA init), ``train_unembed``
    (also adapt the output layer, like Tinker), ``clip_low`` / ``clip_high`` (ppo / cispo ratio
    clip), ``grad_clip_norm`` (0 = off), ``weight_decay``, ``device`` (auto | cpu | cuda | mps),
    ``dtype`` (auto | float32 | bfloat16 | float16), ``micro_batch_size`` (sequences per
    forward/backward pass; gradients accumulate across micro-batches), ``logprob_chunk``
    (completion tokens whose full-vocabulary logits are materialised at once), ``num_threads``
    (sets torch's intra-op threads for the process; 1 is fastest for tiny models on a busy
    machine).
    """

    kind = "local"

    def __init__(self, base_model: str | None, *, lora_rank: int = 8,
                 lora_alpha: float | None = None, seed: int = 0, train_unembed: bool = True,
                 clip_low: float = DEFAULT_CLIP_LOW, clip_high: float = DEFAULT_CLIP_HIGH,
                 grad_clip_norm: float = 1.0, weight_decay: float = 0.0, device: str = "auto",
                 dtype: str = "auto", micro_batch_size: int = 8, logprob_chunk: int = 1024,
                 num_threads: int | None = None):
        import torch
        from peft import LoraConfig, get_peft_model

        from metaclaw.slowloop.causal_lm import load_causal_lm, model_identity

        if num_threads:
            torch.set_num_threads(int(num_threads))
        if lora_rank < 1:
            raise BackendError(f"lora_rank must be a positive integer, got {lora_rank}")
        if micro_batch_size < 1 or logprob_chunk < 1:
            raise BackendError("micro_batch_size and logprob_chunk must be positive integers")
        packaged = base_model in (None, "", "smollm2")
        path = None if packaged else Path(str(base_model)).expanduser()
        if path is not None and not (path / "config.json").is_file() \
                and not (path.is_file() and path.suffix == ".gguf"):
            raise BackendError(
                f"no Hugging Face model at {base_model!r}; pass a local model directory with a "
                "config.json, a .gguf file, or 'smollm2' for the packaged SmolLM2 (`metaclaw "
                "tiny-model DIR` writes a tiny model for offline use)")
        try:
            model, self.tokenizer = load_causal_lm(path, device=device, dtype=dtype)
        except (FileNotFoundError, ValueError, ImportError) as exc:
            raise BackendError(str(exc)) from None
        # recorded with every published version: one name for these weights in every process
        self.base_model = model_identity(None if packaged else path)
        self.lora_rank = lora_rank
        self.clip_low, self.clip_high = clip_low, clip_high
        self.grad_clip_norm = grad_clip_norm
        self.micro_batch_size, self.logprob_chunk = int(micro_batch_size), int(logprob_chunk)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        targets = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                          if isinstance(mod, torch.nn.Linear)})
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        if not train_unembed or tied:
            # A tied output layer shares its weight with the input embeddings: merging an
            # adapter into it (the published sampler) would change the embeddings too, so the
            # sampler would no longer be the trained policy. Tied models keep it frozen.
            out = model.get_output_embeddings()
            out_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is out}
            targets = [t for t in targets if t not in out_names]
        cpu_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            with warnings.catch_warnings():  # a transformers deprecation notice raised by peft
                warnings.simplefilter("ignore", FutureWarning)
                self.model = get_peft_model(model, LoraConfig(
                    r=lora_rank, lora_alpha=lora_alpha or 2 * lora_rank, lora_dropout=0.0,
                    target_modules=targets, bias="none"))
        finally:
            torch.random.set_rng_state(cpu_state)
        self.model.eval()  # no dropout: training logprobs must match sampling logprobs
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        for p in self.params:  # adapters train in fp32 even on a bf16 base (optimizer precision)
            p.data = p.data.float()
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=weight_decay)
        self.policy_version = 0
        self.steps = 0
        self._lock = threading.Lock()
        self._sampler = self._snapshot(0)

    # -- sampling -------------------------------------------------------------------------
    def _snapshot(self, version: int) -> LocalSampler:
        with self._lock:
            frozen = copy.deepcopy(self.model).merge_and_unload()
        frozen.eval()
        for p in frozen.parameters():
            p.requires_grad_(False)
        return LocalSampler(frozen, self.eos_token_id, version)

    def sampler(self) -> LocalSampler:
        """The currently published sampler (weights of the last :meth:`publish`)."""
        return self._sampler

    def sample(self, prompt_tokens: list[int], n: int = 1, max_tokens: int = 64,
               temperature: float = 1.0, seed: int | None = None) -> list[Sample]:
        return self._sampler.sample(prompt_tokens, n, max_tokens, temperature, seed)

    # -- training -------------------------------------------------------------------------
    def forward_backward(self, datums: list[Datum],
                         loss_fn: str = "importance_sampling") -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over ``datums``; returns metrics incl. ``loss``.

        The datums run in micro-batches of ``micro_batch_size`` (similar lengths together, so
        little padding); each micro-batch's summed loss is backpropagated at once, so the
        accumulated gradient is that of the whole batch.
        """
        check_loss_fn(loss_fn)
        if not datums:
            raise ValueError("forward_backward needs at least one Datum")
        order = sorted(range(len(datums)), key=lambda i: len(datums[i].model_input))
        mb = self.micro_batch_size
        total, tokens, weighted = 0.0, 0, {}
        for start in range(0, len(order), mb):
            part = [datums[i] for i in order[start:start + mb]]
            loss_value, stats, n = self._forward_backward_micro(part, loss_fn)
            total += loss_value
            tokens += n
            for key, value in stats.items():
                weighted[key] = weighted.get(key, 0.0) + value * n
        stats = {k: v / max(tokens, 1) for k, v in weighted.items()}
        return {"loss": total, "loss:sum": total, "tokens": tokens, "datums": len(datums),
                "micro_batches": -(-len(datums) // mb), **stats}

    def _forward_backward_micro(self, datums: list[Datum], loss_fn: str):
        import torch

        width = max(len(d.model_input) for d in datums)
        pad = self.tokenizer.pad_token_id or 0
        device = self.device

        def padded(rows, value, dtype):
            return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows],
                                dtype=dtype, device=device)

        input_ids = padded([d.model_input for d in datums], pad, torch.long)
        attention = padded([[1] * len(d.model_input) for d in datums], 0, torch.long)
        targets = padded([d.target_tokens for d in datums], pad, torch.long)
        sampling_lp = padded([d.logprobs for d in datums], 0.0, torch.float32)
        advantages = padded([d.advantages for d in datums], 0.0, torch.float32)
        mask = padded([d.mask for d in datums], 0.0, torch.float32)
        with self._lock:
            logprobs = self._target_logprobs(input_ids, attention, targets, mask)
            loss, stats = policy_loss(loss_fn, logprobs, sampling_lp, advantages, mask,
                                      self.clip_low, self.clip_high)
            loss.backward()
        return float(loss.detach()), stats, int(mask.sum())

    def _target_logprobs(self, input_ids, attention, targets, mask):
        """Log-probabilities (B, T) of the target tokens, in fp32, 0 where ``mask`` is 0.

        Only masked-in (completion) positions go through the output layer, ``logprob_chunk``
        tokens at a time, each chunk under activation checkpointing: its logits are recomputed
        in the backward pass instead of being kept, so at most one chunk's full-vocabulary
        logits exist at any moment.
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        base = self.model.get_base_model()
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
        head = base.get_output_embeddings()
        if decoder is None or head is None:  # an architecture without the usual split
            logits = self.model(input_ids=input_ids, attention_mask=attention).logits.float()
            return torch.log_softmax(logits, -1).gather(2, targets[..., None]).squeeze(-1) * mask
        hidden = decoder(input_ids=input_ids, attention_mask=attention).last_hidden_state
        picked = mask.bool()
        hidden_N = hidden[picked]                    # (N, H): completion positions only
        targets_N = targets[picked]

        def chunk_logprobs(h, t):
            logits = head(h).float()
            return torch.log_softmax(logits, -1).gather(1, t[:, None]).squeeze(1)

        pieces = []
        for start in range(0, hidden_N.shape[0], self.logprob_chunk):
            h = hidden_N[start:start + self.logprob_chunk]
            t = targets_N[start:start + self.logprob_chunk]
            pieces.append(checkpoint(chunk_logprobs, h, t, use_reentrant=False)
                          if h.requires_grad else chunk_logprobs(h, t))
        out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        if pieces:
            out = out.masked_scatter(picked, torch.cat(pieces))
        return out

    def optim_step(self, learning_rate: float) -> dict[str, float]:
        """Apply the accumulated gradients with AdamW at ``learning_rate``, then clear them."""
        import torch

        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be positive, got {learning_rate}")
        with self._lock:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(
                self.params, self.grad_clip_norm if self.grad_clip_norm > 0 else float("inf")))
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1
        return {"grad_norm": grad_norm, "learning_rate": learning_rate}

    def train_step(self, datums: list[Datum], loss_fn: str,
                   learning_rate: float) -> dict[str, float]:
        """:meth:`forward_backward` then :meth:`optim_step`; returns both metrics."""
        metrics = self.forward_backward(datums, loss_fn)
        metrics.update(self.optim_step(learning_rate))
        return metrics

    def publish(self, version: int | None = None) -> int:
        """Freeze the current weights as the sampling policy; returns its policy version."""
        version = self.policy_version + 1 if version is None else int(version)
        self._sampler = self._snapshot(version)
        self.policy_version = version
        return version

    # -- state ----------------------------------------------------------------------------
    def save_state(self, path: str) -> str:
        """Save LoRA weights, optimizer state and counters in directory ``path``; returns it."""
        import torch

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.model.save_pretrained(str(out), save_embedding_layers=False)
            torch.save(self.optimizer.state_dict(), out / "optimizer.pt")
        (out / "metaclaw_state.json").write_text(json.dumps({
            "backend": self.kind, "base_model": self.base_model, "lora_rank": self.lora_rank,
            "policy_version": self.policy_version, "steps": self.steps}))
        return str(out)

    def load_state(self, path: str) -> None:
        """Restore a :meth:`save_state` directory (weights, optimizer, counters) and publish the
        restored weights as the sampling policy under their saved policy version."""
        import torch
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        src = Path(path)
        meta = read_state(src)
        if meta.get("base_model") not in (None, self.base_model):
            raise BackendError(f"the state in {path!r} was trained on {meta['base_model']}, not "
                               f"{self.base_model}")
        if meta.get("lora_rank") != self.lora_rank:
            raise BackendError(
                f"the state in {path!r} has LoRA rank {meta.get('lora_rank')}, this backend "
                f"{self.lora_rank}; create the backend with lora_rank={meta.get('lora_rank')}")
        with self._lock:
            try:
                weights = load_file(str(src / "adapter_model.safetensors"))
                # an older published version keeps its weights only (retention drops the
                # optimizer's state, the larger part): the optimizer then starts afresh
                optimizer = torch.load(src / "optimizer.pt", weights_only=True) \
                    if (src / "optimizer.pt").exists() else None
            except Exception as exc:  # truncated or foreign files: nothing is half-restored
                raise BackendError(f"cannot load the training state saved in {str(src)!r} "
                                   f"({type(exc).__name__}: {exc}); restore it, or start "
                                   "afresh without it") from exc
            try:
                set_peft_model_state_dict(self.model, weights)
            except RuntimeError as exc:  # shapes of another model: said in one line
                raise BackendError(f"the state in {str(src)!r} does not fit this model "
                                   f"({_first_line(exc)})") from None
            if optimizer is not None:
                self.optimizer.load_state_dict(optimizer)
            else:
                self.optimizer.state.clear()
        self.steps = int(meta.get("steps", 0))
        self.policy_version = int(meta.get("policy_version", 0))
        self._sampler = self._snapshot(self.policy_version)
