"""Backends: each loss against hand-computed values; the local backend's sampler / training
separation and state round trip; the Tinker backend against a recording double of the SDK's
client classes (real ``tinker.types`` objects, real SDK futures) and its fast preflight.

The Tinker service is not reachable here, so ``tinker.ServiceClient()`` is never constructed:
the double below stands in for it (clearly an offline double; it computes nothing it reports
as a model's result beyond echoing the sampling logprobs back as learner logprobs)."""

from __future__ import annotations

import http.server
import math
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from metaclaw.slowloop.backends import BackendError, Datum, make_backend


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from metaclaw.offline.tinymodel import write_tiny_model

    torch.set_num_threads(1)
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


# -- losses by hand --------------------------------------------------------------------------
# One sequence of 3 target positions; position 0 is a prompt position (masked) carrying a
# bogus advantage that must be ignored.
LOGP = [-1.0, -0.4, -2.0]
SAMPLING = [-1.0, -0.5, -1.5]
ADV = [5.0, 1.0, -2.0]
MASK = [0.0, 1.0, 1.0]
R1, R2 = math.exp(0.1), math.exp(-0.5)          # ratios at positions 1 and 2


def _loss(loss_fn):
    import torch

    from metaclaw.slowloop.backends.local import policy_loss

    logp = torch.tensor([LOGP], requires_grad=True)
    loss, stats = policy_loss(loss_fn, logp, torch.tensor([SAMPLING]), torch.tensor([ADV]),
                              torch.tensor([MASK]))
    loss.backward()
    return float(loss.detach()), logp.grad[0].tolist(), stats


def test_importance_sampling_loss_by_hand():
    loss, grad, stats = _loss("importance_sampling")
    assert loss == pytest.approx(-(R1 * 1.0 + R2 * -2.0))          # 0.107886
    assert loss == pytest.approx(0.107886, abs=1e-5)
    assert grad == pytest.approx([0.0, -R1 * 1.0, -R2 * -2.0], abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx((R1 + R2) / 2)


def test_ppo_clipped_loss_by_hand():
    loss, grad, stats = _loss("ppo")
    # position 1: ratio 1.105 inside [0.8, 1.2] -> 1.105 * 1; position 2: ratio 0.607 < 0.8 with
    # A = -2: min(0.607 * -2, 0.8 * -2) = -1.6 (clipped, no gradient)
    assert loss == pytest.approx(-(R1 * 1.0 + 0.8 * -2.0))          # 0.494829
    assert loss == pytest.approx(0.494829, abs=1e-5)
    assert grad == pytest.approx([0.0, -R1, 0.0], abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(0.5)


def test_cispo_loss_by_hand():
    loss, grad, _ = _loss("cispo")
    # sg(clip(ratio)) * logp * A: 1.105 * -0.4 * 1 + 0.8 * -2.0 * -2 = -0.442068 + 3.2
    assert loss == pytest.approx(-(R1 * -0.4 * 1.0 + 0.8 * -2.0 * -2.0))
    assert loss == pytest.approx(-2.757932, abs=1e-5)
    assert grad == pytest.approx([0.0, -R1 * 1.0, -0.8 * -2.0], abs=1e-6)


def test_unknown_loss_is_one_clear_error(tiny_model):
    backend = make_backend("local", tiny_model)
    d = Datum.from_sample([4, 5], [6], [-1.0], 1.0)
    with pytest.raises(ValueError, match="choose one of importance_sampling, ppo, cispo"):
        backend.forward_backward([d], "dpo")


# -- the local backend -----------------------------------------------------------------------
def test_local_backend_on_policy_loss_and_published_sampler_isolation(tiny_model):
    backend = make_backend("local", tiny_model, lora_rank=4, seed=0)
    prompt = backend.render_chat([{"role": "user", "content": "say yes"}])
    assert backend.decode(prompt).startswith("<|user|>") is False  # specials skipped on decode
    samples = backend.sample(prompt, n=4, max_tokens=6, seed=3)
    assert all(len(s.tokens) == len(s.logprobs) >= 1 for s in samples)
    assert backend.sample(prompt, n=4, max_tokens=6, seed=3)[0].tokens == samples[0].tokens
    datums = [Datum.from_sample(prompt, s.tokens, s.logprobs, a)
              for s, a in zip(samples, [1.0, -1.0, 0.5, -0.5])]
    metrics = backend.forward_backward(datums, "importance_sampling")
    # on-policy the ratio is exactly 1, so the IS loss is -sum(advantage x completion tokens)
    expected = -sum(a * len(s.tokens) for s, a in zip(samples, [1.0, -1.0, 0.5, -0.5]))
    assert metrics["loss"] == pytest.approx(expected, abs=1e-4)
    assert metrics["tokens"] == sum(len(s.tokens) for s in samples)

    old = backend.sampler()
    before = old.sample(prompt, n=2, max_tokens=6, seed=11)
    backend.optim_step(0.05)
    # training changed the LoRA weights but not the published sampler
    assert [s.logprobs for s in old.sample(prompt, n=2, max_tokens=6, seed=11)] == \
        [s.logprobs for s in before]
    assert backend.publish() == 1 and backend.sampler() is not old
    after = backend.sampler().sample(prompt, n=2, max_tokens=6, seed=11)
    assert [s.logprobs for s in after] != [s.logprobs for s in before]


def test_local_backend_state_round_trip_and_errors(tiny_model, tmp_path):
    a = make_backend("local", tiny_model, lora_rank=4, seed=0)
    prompt = a.encode("say yes")
    s = a.sample(prompt, n=2, max_tokens=4, seed=1)
    a.train_step([Datum.from_sample(prompt, x.tokens, x.logprobs, 1.0) for x in s],
                 "ppo", 0.05)
    a.publish()
    path = a.save_state(str(tmp_path / "state"))
    b = make_backend("local", tiny_model, lora_rank=4, seed=9)
    b.load_state(path)
    assert b.policy_version == 1 and b.steps == 1
    ref = a.sampler().sample(prompt, n=2, max_tokens=4, seed=5)
    got = b.sampler().sample(prompt, n=2, max_tokens=4, seed=5)
    assert [x.tokens for x in got] == [x.tokens for x in ref]
    with pytest.raises(BackendError, match="lora_rank=4"):
        make_backend("local", tiny_model, lora_rank=8).load_state(path)
    (Path(path) / "adapter_model.safetensors").write_bytes(b"garbage")  # a corrupt checkpoint
    with pytest.raises(BackendError, match="cannot load the training state saved in"):
        b.load_state(path)
    assert b.policy_version == 1  # nothing half-restored
    with pytest.raises(BackendError, match="tiny-model"):
        make_backend("local", str(tmp_path / "nowhere"))
    with pytest.raises(BackendError, match="--backend local or --backend tinker"):
        make_backend("cloud", "x")


def test_micro_batches_and_chunked_logprobs_give_the_whole_batch_gradient(tiny_model):
    """Micro-batches of 1 with 3-token logprob chunks accumulate exactly the gradient of one
    full-vocabulary pass over the whole batch (the sum loss makes accumulation exact)."""
    import torch

    def grads(**cfg):
        backend = make_backend("local", tiny_model, lora_rank=4, seed=0, device="cpu", **cfg)
        prompt = backend.render_chat([{"role": "user", "content": "say yes"}])
        samples = backend.sample(prompt, n=4, max_tokens=7, seed=2)
        datums = [Datum.from_sample(prompt[: len(prompt) - i], s.tokens, s.logprobs, a)
                  for i, (s, a) in enumerate(zip(samples, [1.0, -1.0, 0.5, -0.25]))]
        metrics = backend.forward_backward(datums, "ppo")
        return metrics, [p.grad.clone() for p in backend.params]

    whole, g_whole = grads(micro_batch_size=8, logprob_chunk=10_000)
    split, g_split = grads(micro_batch_size=1, logprob_chunk=3)
    assert whole["micro_batches"] == 1 and split["micro_batches"] == 4
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-4)
    assert split["tokens"] == whole["tokens"]
    for a, b in zip(g_whole, g_split):
        assert torch.allclose(a, b, atol=1e-5)


def test_device_choice_and_cuda_safe_generator(tiny_model):
    """Devices resolve with one clear error when unavailable; the sampler's random generator
    lives on the model's device (a CPU generator cannot drive sampling on CUDA)."""
    import torch

    from metaclaw.slowloop.backends.local import _generator
    from metaclaw.slowloop.causal_lm import resolve_device, resolve_dtype

    backend = make_backend("local", tiny_model, device="auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert backend.device.type in (expected, "mps")
    assert backend.sampler().device == backend.device
    assert _generator(1, backend.device).device.type == backend.device.type
    assert resolve_dtype("auto", "cpu") is torch.float32
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pass --device cpu"):
            resolve_device("cuda")
        with pytest.raises(BackendError, match="no CUDA GPU"):
            make_backend("local", tiny_model, device="cuda")


def test_device_names_resolve_to_this_machine_or_fail_in_one_sentence(tiny_model):
    """``auto`` picks what this machine has (CPU here unless torch sees a GPU); an explicit
    accelerator this torch cannot use fails before any model is loaded, in one sentence naming
    the flag to change, from the backend, the served model and the CLI alike."""
    import torch

    from metaclaw.offline.localmodel import LocalModelError, load_responder
    from metaclaw.slowloop.causal_lm import resolve_device

    cuda = torch.cuda.is_available()
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    assert resolve_device("auto") == ("cuda" if cuda else "mps" if mps else "cpu")
    assert resolve_device("cpu") == "cpu"
    if not mps:
        with pytest.raises(ValueError, match="'mps' requested.*pass --device cpu"):
            resolve_device("mps")
    if cuda:
        return  # the errors below are about a machine without a CUDA GPU
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="no CUDA GPU; pass --device cpu"):
            resolve_device(device)
    with pytest.raises(LocalModelError, match="no CUDA GPU; pass --device cpu"):
        load_responder(tiny_model, device="cuda")
    with pytest.raises(BackendError, match="no CUDA GPU"):
        make_backend("local", tiny_model, device="cuda:0")


def test_local_model_cli_names_the_device_flag_without_cuda(tiny_model, capsys):
    import torch

    from metaclaw.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["local-model", tiny_model, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("metaclaw local-model: device 'cuda' requested but torch sees no "
                           "CUDA GPU; pass --device cpu (or auto)")


def test_generators_live_on_the_model_device_and_reproduce(tiny_model):
    """The trainer's published snapshot and the served model each draw from a generator on
    their model's device (a CPU generator cannot drive sampling on a GPU); a seed reproduces
    the draw."""
    import torch

    from metaclaw.offline.localmodel import load_responder
    from metaclaw.slowloop.backends.local import _generator

    backend = make_backend("local", tiny_model, lora_rank=4, device="cpu")
    served = load_responder(tiny_model, device="cpu").backend
    for sampler in (backend.sampler(), served.sampler()):
        model_device = next(sampler.model.parameters()).device
        assert sampler.device == model_device
        assert _generator(3, sampler.device).device.type == model_device.type
    a = torch.rand(4, generator=_generator(3, "cpu"))
    assert torch.equal(a, torch.rand(4, generator=_generator(3, "cpu")))


def test_sampling_passes_the_kv_cache_without_a_deprecation_warning(tiny_model):
    """Every decoding step hands the model its KV cache under the keyword its forward declares.
    transformers 5.24 renamed ``past_key_values`` to ``cache``: the old keyword still works
    there, but warns (FutureWarning) on every step and logs a notice when the output's old
    attribute is read. Neither may appear while sampling or streaming."""
    import logging
    import re
    import warnings

    from transformers.utils import logging as hf_logging

    from metaclaw.slowloop.backends.local import LocalSampler
    from metaclaw.slowloop.causal_lm import load_causal_lm

    model, _ = load_causal_lm(tiny_model, device="cpu")
    sampler = LocalSampler(model, None, 0)  # no end-of-sequence: every step reuses the cache
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_root = logging.getLogger("transformers")
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):  # a notice logged once by an earlier test would hide here
        once.cache_clear()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    hf_root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            samples = sampler.sample([3, 4, 10], n=2, max_tokens=5, temperature=1.0, seed=0)
            streamed = list(sampler.stream([3, 4, 10], max_tokens=5, temperature=0.0))
    finally:
        hf_root.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert [len(s.tokens) for s in samples] == [5, 5] and len(streamed) == 5
    about_cache = re.compile(r"past_key_values|cache", re.IGNORECASE)
    noticed = [f"{w.category.__name__}: {w.message}" for w in caught
               if issubclass(w.category, (DeprecationWarning, FutureWarning))
               and about_cache.search(str(w.message))]
    noticed += [r.getMessage() for r in records
                if r.levelno >= logging.WARNING and about_cache.search(r.getMessage())]
    assert noticed == []


def test_cached_decoding_matches_a_full_forward_pass(tiny_model):
    """The cache handed back at each step is the one the model reads: the sampled tokens'
    logprobs equal those of one uncached forward pass over prompt + completion (a cache passed
    under a keyword the model ignores would leave each step seeing only its newest token)."""
    import torch

    from metaclaw.slowloop.backends.local import LocalSampler
    from metaclaw.slowloop.causal_lm import load_causal_lm

    model, _ = load_causal_lm(tiny_model, device="cpu")
    sampler = LocalSampler(model, None, 0)
    prompt = [3, 4, 10, 11]
    for temperature in (1.0, 0.0):
        (sample,) = sampler.sample(prompt, n=1, max_tokens=6, temperature=temperature, seed=2)
        ids = torch.tensor([prompt + sample.tokens])
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        full = logp.gather(1, ids[0, len(prompt):, None]).squeeze(1)
        assert sample.logprobs == pytest.approx(full.tolist(), abs=1e-4)
        if temperature == 0:
            assert sample.tokens == logits.argmax(dim=-1).tolist()


def test_bfloat16_weights_train_with_fp32_adapters_and_are_served(tiny_model, tmp_path):
    """The GPU precision path, run on CPU: bfloat16 base weights, fp32 LoRA adapters and
    optimizer, fp32 logprobs through micro-batches and chunked logprobs; the published snapshot
    keeps the base dtype, and a bfloat16 served model adopting the saved state samples exactly
    what the trainer's published snapshot samples."""
    import torch

    from metaclaw.offline.localmodel import load_responder

    backend = make_backend("local", tiny_model, lora_rank=4, seed=0, device="cpu",
                           dtype="bfloat16", micro_batch_size=2, logprob_chunk=3)
    assert backend.dtype is torch.bfloat16
    assert {p.dtype for p in backend.params} == {torch.float32}
    prompt = backend.render_chat([{"role": "user", "content": "say yes"}])
    samples = backend.sample(prompt, n=4, max_tokens=6, seed=1)
    assert all(isinstance(lp, float) and lp <= 0 for s in samples for lp in s.logprobs)
    metrics = backend.train_step([Datum.from_sample(prompt, s.tokens, s.logprobs, a) for s, a
                                  in zip(samples, [1.0, -1.0, 1.0, -1.0])], "ppo", 0.05)
    assert metrics["micro_batches"] == 2 and math.isfinite(metrics["loss"])
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    backend.publish()
    assert next(backend.sampler().model.parameters()).dtype is torch.bfloat16
    checkpoint = backend.save_state(str(tmp_path / "state"))

    served = load_responder(tiny_model, device="cpu", dtype="bfloat16").backend
    adopted = served.published_sampler(1, "local", backend.base_model, checkpoint)
    assert next(adopted.model.parameters()).dtype is torch.bfloat16
    assert adopted.device == next(served.model.parameters()).device
    ref = backend.sampler().sample(prompt, 2, 6, 1.0, seed=5)
    assert [s.tokens for s in adopted.sample(prompt, 2, 6, 1.0, seed=5)] == \
        [s.tokens for s in ref]


def test_batching_options_are_checked(tiny_model):
    for bad in ({"micro_batch_size": 0}, {"logprob_chunk": 0}):
        with pytest.raises(BackendError, match="must be positive integers"):
            make_backend("local", tiny_model, **bad)


# -- Tinker: a recording double of the SDK clients ------------------------------------------
def _done(value):
    """A real SDK future (``AwaitableConcurrentFuture``) already holding ``value``."""
    from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

    fut: Future = Future()
    fut.set_result(value)
    return AwaitableConcurrentFuture(fut)


class RecordingSamplingClient:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def sample(self, prompt, num_samples, sampling_params, include_prompt_logprobs=False,
               topk_prompt_logprobs=0, topk_sample_logprobs=0, target_prompt_logprobs=None,
               prompt_alt_tokens_k=0, prompt_logprobs_last_n=None):
        from tinker import types

        assert isinstance(prompt, types.ModelInput)
        assert isinstance(sampling_params, types.SamplingParams)
        self.log.append(("SamplingClient.sample", self.name, prompt.to_ints(), num_samples,
                         sampling_params))
        seqs = []
        for i in range(num_samples):  # sample i says "yes" i times, then stops
            tokens = np.array([7] * i + [2], dtype=np.int32)
            logprobs = np.array([-0.25 * (k + 1) for k in range(i + 1)], dtype=np.float32)
            seqs.append(types.SampledSequence(stop_reason="stop", sequence_id=f"s{i}",
                                              tokens_np=tokens, logprobs_np=logprobs))
        return _done(types.SampleResponse(sequences=seqs))


class RecordingTrainingClient:
    def __init__(self, log):
        self.log = log
        self.published = 0

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        from tinker import types

        self.log.append(("TrainingClient.forward_backward", data, loss_fn, loss_fn_config))
        outputs, loss = [], 0.0
        for d in data:
            assert isinstance(d, types.Datum)
            lp = d.loss_fn_inputs["logprobs"]
            adv = d.loss_fn_inputs["advantages"].to_numpy()
            loss -= float(adv.sum())  # importance sampling at ratio 1 (learner = sampler)
            outputs.append({"logprobs": types.TensorData(data=lp.to_numpy(), dtype="float32",
                                                         shape=lp.shape)})
        return _done(types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord",
                                                 loss_fn_outputs=outputs,
                                                 metrics={"loss:sum": loss}))

    def optim_step(self, optim_params=None, *, adam_params=None):
        from tinker import types

        self.log.append(("TrainingClient.optim_step", optim_params))
        return _done(types.OptimStepResponse(metrics={"grad_norm": 0.5}))

    def save_weights_and_get_sampling_client(self, name=None, retry_config=None,
                                             record_stability_info=False, kind="snapshot"):
        self.published += 1
        self.log.append(("TrainingClient.save_weights_and_get_sampling_client",))
        return _done(RecordingSamplingClient(self.log, f"weights-{self.published}"))

    def save_weights_for_sampler(self, name, ttl_seconds=None, user_metadata=None):
        from tinker import types

        self.log.append(("TrainingClient.save_weights_for_sampler", name))
        return _done(types.SaveWeightsForSamplerResponse(path=f"tinker://run-1/sampler/{name}"))

    def create_sampling_client(self, model_path, retry_config=None, record_stability_info=False):
        self.log.append(("TrainingClient.create_sampling_client", model_path))
        return _done(RecordingSamplingClient(self.log, model_path))

    def save_state(self, name, ttl_seconds=None, overwrite=False, user_metadata=None):
        from tinker import types

        self.log.append(("TrainingClient.save_state", name, user_metadata))
        return _done(types.SaveWeightsResponse(path=f"tinker://run-1/weights/{name}"))

    def get_tokenizer(self):
        from metaclaw.offline.tinymodel import build_tokenizer

        return build_tokenizer()


class RecordingServiceClient:
    def __init__(self):
        self.log: list[tuple] = []

    def create_lora_training_client(self, base_model, rank=32, seed=None, train_mlp=True,
                                    train_attn=True, train_unembed=True, user_metadata=None,
                                    optimizer=None):
        self.log.append(("ServiceClient.create_lora_training_client", base_model, rank, seed))
        return _done(RecordingTrainingClient(self.log))

    def create_training_client_from_state_with_optimizer(self, path, base_model=None,
                                                         user_metadata=None,
                                                         weights_access_token=None):
        self.log.append(("ServiceClient.create_training_client_from_state_with_optimizer", path))
        return _done(RecordingTrainingClient(self.log))


def test_the_double_mirrors_real_non_deprecated_sdk_methods():
    import inspect

    import tinker

    pairs = [(RecordingServiceClient, tinker.ServiceClient),
             (RecordingTrainingClient, tinker.TrainingClient),
             (RecordingSamplingClient, tinker.SamplingClient)]
    for double, real in pairs:
        for name, fn in vars(double).items():
            if name.startswith("_") or not callable(fn) or name == "get_tokenizer":
                continue
            real_fn = getattr(real, name)
            assert getattr(real_fn, "__deprecated__", None) is None, name
            real_params = list(inspect.signature(real_fn).parameters)
            assert list(inspect.signature(fn).parameters) == real_params, name


def test_tinker_backend_builds_real_types_and_calls_the_api_in_order(tmp_path):
    from tinker import types

    from metaclaw.slowloop.grpo import GRPOConfig, Task, prompts_from_tasks, train_grpo

    service = RecordingServiceClient()
    backend = make_backend("tinker", "Qwen/Qwen3-4B-Instruct-2507", lora_rank=16, seed=3,
                           service_client=service)
    tasks = [Task("say yes", lambda text: text.split().count("yes") / 3),
             Task("answer yes", lambda text: text.split().count("yes") / 3)]
    config = GRPOConfig(steps=2, groups_per_step=2, group_size=3, max_tokens=5,
                        learning_rate=4e-5, loss_fn="ppo", state_dir=str(tmp_path / "st"))
    result = train_grpo(backend, prompts_from_tasks(backend, tasks), config=config)
    names = [entry[0] for entry in service.log]
    assert names == [
        "ServiceClient.create_lora_training_client",
        "TrainingClient.save_weights_and_get_sampling_client",   # version 0 (initial weights)
        "SamplingClient.sample", "SamplingClient.sample",        # both groups in flight
        "TrainingClient.forward_backward", "TrainingClient.optim_step",  # submitted, then waited
        "TrainingClient.save_weights_and_get_sampling_client",   # version 1
        "SamplingClient.sample", "SamplingClient.sample",
        "TrainingClient.forward_backward", "TrainingClient.optim_step",
        "TrainingClient.save_weights_and_get_sampling_client",   # version 2
        "TrainingClient.save_state",
    ]
    assert service.log[0][1:] == ("Qwen/Qwen3-4B-Instruct-2507", 16, 3)
    samples = [e for e in service.log if e[0] == "SamplingClient.sample"]
    assert [e[1] for e in samples] == ["weights-1"] * 2 + ["weights-2"] * 2  # new weights/step
    assert samples[0][3] == 3 and samples[0][4].max_tokens == 5 and samples[0][4].temperature == 1

    _, data, loss_fn, loss_cfg = service.log[4]
    assert loss_fn == "ppo" and loss_cfg == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    prompt = samples[0][2]
    assert len(data) == 6 and all(isinstance(d, types.Datum) for d in data)
    d2 = data[2]  # the sample that said "yes" twice, then stopped: tokens [7, 7, 2]
    assert isinstance(d2.model_input, types.ModelInput)
    assert d2.model_input.to_ints() == prompt + [7, 7]
    targets = d2.loss_fn_inputs["target_tokens"]
    assert isinstance(targets, types.TensorData) and targets.dtype == "int64"
    assert targets.tolist() == prompt[1:] + [7, 7, 2] and targets.shape == [len(prompt) + 2]
    logprobs = d2.loss_fn_inputs["logprobs"]
    assert logprobs.dtype == "float32"
    assert logprobs.tolist() == pytest.approx([0.0] * (len(prompt) - 1) + [-0.25, -0.5, -0.75])
    advantages = d2.loss_fn_inputs["advantages"].tolist()
    # rewards 0, 1/3, 2/3 -> group advantages -1.2247, 0, +1.2247 on completion tokens only
    assert advantages[:len(prompt) - 1] == [0.0] * (len(prompt) - 1)
    assert advantages[len(prompt) - 1:] == pytest.approx([1.224745] * 3, abs=1e-5)
    assert set(d2.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"}

    optim = service.log[5][1]
    assert isinstance(optim, types.AdamParams) and optim.learning_rate == 4e-5
    name, metadata = service.log[-1][1:]
    assert name == "step-000001" and metadata["policy_version"] == "2"
    h = result.history[0]
    assert h["loss"] == pytest.approx(-sum(sum(d.loss_fn_inputs["advantages"].tolist())
                                           for d in data))
    assert h["metrics"]["ratio_mean"] == pytest.approx(1.0)
    assert h["metrics"]["grad_norm"] == 0.5
    assert result.policy_version == 2


def test_tinker_resume_and_durable_sampler_checkpoints():
    service = RecordingServiceClient()
    backend = make_backend("tinker", "m", service_client=service,
                           resume_from="tinker://run-1/weights/step-000004",
                           sampler_checkpoints=True)
    assert [e[0] for e in service.log] == [
        "ServiceClient.create_training_client_from_state_with_optimizer",
        "TrainingClient.save_weights_for_sampler", "TrainingClient.create_sampling_client"]
    assert service.log[0][1] == "tinker://run-1/weights/step-000004"
    assert backend.publish() == 1
    assert backend.last_sampler_path == "tinker://run-1/sampler/policy-000001"
    assert backend.sampler().path == backend.last_sampler_path
    with pytest.raises(BackendError, match="tinker://"):
        backend.load_state(str("/tmp/some/dir"))
    backend.load_state("tinker://run-1/weights/step-000009")
    assert service.log[-3][0] == "ServiceClient.create_training_client_from_state_with_optimizer"


def test_tinker_refusing_to_start_is_one_sentence_naming_the_key():
    """No key (or a wrong one, a model the service does not serve): the SDK's TinkerError
    ended `metaclaw train` in a traceback."""
    import tinker

    class Refusing(RecordingServiceClient):
        def create_lora_training_client(self, *args, **kwargs):
            raise tinker.TinkerError("The api_key client option must be set either by passing "
                                     "api_key to the client or by setting TINKER_API_KEY")

    with pytest.raises(BackendError, match="Tinker refused to start training 'm'.*set "
                                           "TINKER_API_KEY"):
        make_backend("tinker", "m", service_client=Refusing())


# -- Tinker preflight ------------------------------------------------------------------------
def test_preflight_fails_fast_with_a_clear_message_when_unreachable():
    import tinker.lib.base_url  # noqa: F401 - imported before the clock starts (1.5 s, more loaded)

    silent = socket.socket()  # accepts connections but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens here
    try:
        for url in (f"http://127.0.0.1:{silent.getsockname()[1]}",
                    f"http://127.0.0.1:{closed_port}"):
            t0 = time.perf_counter()
            with pytest.raises(BackendError, match="cannot reach the Tinker service"):
                make_backend("tinker", "Qwen/Qwen3-4B-Instruct-2507", base_url=url,
                             preflight_timeout=1.0)
            assert time.perf_counter() - t0 < 3.0
    finally:
        silent.close()


def test_preflight_accepts_any_http_answer():
    from metaclaw.slowloop.backends.tinker import preflight

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert preflight(url, timeout=2.0) == url
    finally:
        server.shutdown()


# -- the tiny model --------------------------------------------------------------------------
def test_tiny_model_is_deterministic_and_loads_like_any_hf_model(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from metaclaw.offline.tinymodel import write_tiny_model

    again = write_tiny_model(tmp_path / "again", seed=0)
    other = write_tiny_model(tmp_path / "other", seed=1)
    weights = [open(f"{p}/model.safetensors", "rb").read() for p in (tiny_model, again, other)]
    assert weights[0] == weights[1] and weights[0] != weights[2]
    model = AutoModelForCausalLM.from_pretrained(str(again))
    tokenizer = AutoTokenizer.from_pretrained(str(again))
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Please say yes!"}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    assert tokenizer.decode(ids) == "<|user|> please say yes ! <|end|> <|assistant|>"
    assert tokenizer.eos_token == "<|end|>" and tokenizer.eos_token_id in ids
