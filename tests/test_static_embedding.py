"""Static token embeddings: distillation from a (tiny, random) BERT, the disk cache, encoding."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from metaclaw.skills import static_embedding  # noqa: E402
from metaclaw.skills.retrieval import minilm_model_path  # noqa: E402


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A 1-layer, 32-wide BERT with random weights and all-MiniLM-L6-v2's tokenizer."""
    import torch
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64)
    BertModel(config).save_pretrained(folder)
    shutil.copy(f"{minilm_model_path()}/tokenizer.json", folder / "tokenizer.json")
    return folder


def test_distill_is_cached_on_disk_and_reused(tiny_bert, tmp_path, monkeypatch):
    first = static_embedding.load(tiny_bert, dims=16, directory=tmp_path)
    assert first.table.shape == (30522, 16) and first.table.dtype == np.float32
    assert len(list(tmp_path.glob("*.npy"))) == 1

    def no_distill(*args, **kwargs):
        raise AssertionError("the cached table should have been used")

    monkeypatch.setattr(static_embedding, "distill", no_distill)
    again = static_embedding.load(tiny_bert, dims=16, directory=tmp_path)
    assert np.array_equal(again.table, first.table)
    with pytest.raises(AssertionError, match="cached table"):  # other dims: another table
        static_embedding.load(tiny_bert, dims=8, directory=tmp_path)


def test_the_cache_key_follows_the_model_files(tiny_bert, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_bert, copy)
    key = static_embedding.cache_key(copy)
    assert static_embedding.cache_key(copy) == key
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("32", "33", 1))
    assert static_embedding.cache_key(copy) != key


def test_encode_is_the_normalized_mean_of_token_rows(tiny_bert, tmp_path):
    model = static_embedding.load(tiny_bert, dims=16, directory=tmp_path)
    ids = model.tokenizer.encode("keep a copy", add_special_tokens=False).ids
    expected = model.table[ids].mean(axis=0)
    expected /= np.linalg.norm(expected)
    vectors = model.encode(["keep a copy", "", "keep a copy " * 300])
    assert vectors.shape == (3, 16)
    assert np.allclose(vectors[0], expected, atol=1e-6)
    assert np.allclose(model.encode_one("keep a copy"), expected, atol=1e-6)
    assert not vectors[1].any()  # no tokens: a zero vector, cosine 0 with everything
    assert np.isclose(np.linalg.norm(vectors[2]), 1.0)  # long texts are not truncated or padded
    # frequent tokens weigh less: row norms grow with the token id (rarity weighting), and
    # function words weigh nothing
    norms = np.linalg.norm(model.table, axis=1)
    assert np.median(norms[20000:]) > np.median(norms[2000:3000])
    weights = static_embedding.rarity_weights(model.tokenizer)
    first = model.tokenizer.token_to_id("the") or 0
    assert np.median(weights[first + 1:first + 50]) < np.median(weights[first + 1000:
                                                                       first + 1050])
    assert weights.max() < 1.0
    for word in ("the", "a", "please"):
        if model.tokenizer.token_to_id(word) is not None:
            assert weights[model.tokenizer.token_to_id(word)] == 0


def test_a_model_without_a_fast_tokenizer_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        static_embedding.load(tmp_path, directory=tmp_path / "cache")


def test_a_corrupt_cached_table_is_derived_again(tiny_bert, tmp_path):
    """A table cut short (a copy from a full disk, a file truncated by hand) or of another shape
    is derived again instead of failing every later query."""
    first = static_embedding.load(tiny_bert, dims=16, directory=tmp_path)
    (cached,) = tmp_path.glob("*.npy")
    data = cached.read_bytes()
    cached.write_bytes(data[:len(data) // 3])
    again = static_embedding.load(tiny_bert, dims=16, directory=tmp_path)
    assert np.array_equal(again.table, first.table)
    np.save(cached, np.zeros((5, 16), dtype=np.float16))  # a valid array, not this model's
    again = static_embedding.load(tiny_bert, dims=16, directory=tmp_path)
    assert np.array_equal(again.table, first.table)
    assert np.load(cached).shape == (30522, 16)


def test_an_unwritable_cache_folder_still_gives_a_table(tiny_bert, tmp_path, caplog):
    """Where the cache cannot be written the table is derived in memory, with a warning that
    says which folder to set."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level("WARNING"):
        model = static_embedding.load(tiny_bert, dims=16, directory=blocker / "cache")
    assert model.table.shape == (30522, 16)
    assert "METACLAW_CACHE_DIR" in caplog.text


@pytest.fixture
def no_home_cache(tmp_path, monkeypatch):
    """No METACLAW_CACHE_DIR, and a home cache folder that cannot be created (a file is in the
    way); returns that file, under which nothing can be created either."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.delenv("METACLAW_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "xdg"))
    return blocker


def test_cache_dir_falls_back_when_neither_home_nor_temp_is_writable(no_home_cache, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(no_home_cache / "tmp"))
    assert static_embedding.cache_dir() is None


def test_a_prepared_table_is_used_even_where_the_cache_is_read_only(tiny_bert, tmp_path,
                                                                     monkeypatch):
    """An image may ship the table in a read-only METACLAW_CACHE_DIR: it is read, not derived
    again elsewhere."""
    prepared = tmp_path / "prepared"
    first = static_embedding.load(tiny_bert, dims=16, directory=prepared / "static-embeddings")
    monkeypatch.setenv("METACLAW_CACHE_DIR", str(prepared))
    monkeypatch.setattr(static_embedding, "cache_dir", lambda: None)  # nothing writable

    def no_distill(*args, **kwargs):
        raise AssertionError("the prepared table should have been used")

    monkeypatch.setattr(static_embedding, "distill", no_distill)
    again = static_embedding.load(tiny_bert, dims=16)
    assert np.array_equal(again.table, first.table)


def test_the_temp_fallback_is_per_user(no_home_cache, tmp_path, monkeypatch):
    import os
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert static_embedding.cache_dir() == (
        tmp_path / "tmp" / f"metaclaw-cache-{os.getuid()}" / "static-embeddings")


def test_a_temp_folder_someone_else_could_have_filled_is_never_used(no_home_cache, tmp_path,
                                                                     monkeypatch):
    """The per-user temp folder is used only when it is this user's and no one else can write
    to it: another local user could make it first (open to all, or a link to their own folder)
    and put a table or model of their own in it."""
    import os
    import tempfile

    from metaclaw.fileio import private_temp_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    mine = private_temp_dir("mine")
    assert mine == tmp_path / "tmp" / "mine" and (mine.stat().st_mode & 0o777) == 0o700
    (tmp_path / "tmp" / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "tmp" / "open", 0o777)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "tmp" / "linked").symlink_to(tmp_path / "elsewhere")
    assert private_temp_dir("open") is None and private_temp_dir("linked") is None
    os.chmod(tmp_path / "tmp", 0o755)
    planted = tmp_path / "tmp" / f"metaclaw-cache-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    assert static_embedding.cache_dir() is None  # not the planted folder


def test_a_written_table_is_read_back_as_the_packaged_one_is(tiny_bert, tmp_path):
    """``write_table`` (what benchmarks/train_static_table.py writes the packaged folder with)
    gives a folder ``packaged`` reads: the rows within int8's half step, the notice beside."""
    table = np.random.default_rng(0).normal(size=(30522, 8)).astype(np.float32)
    folder = static_embedding.write_table(table, tiny_bert, tmp_path / "table", {"dims": 8},
                                          "NOTICE text\n")
    read = static_embedding.packaged(folder)
    assert read is not None and read.table.shape == table.shape
    step = np.abs(table).max(axis=1, keepdims=True) / 127
    assert (np.abs(read.table - table) <= step / 2 + 1e-6).all()
    assert (folder / "NOTICE").read_text() == "NOTICE text\n"
    assert '"dims": 8' in (folder / "info.json").read_text()
    assert not read.trained  # its info says no training: retrieval uses a distilled table's
    static_embedding.write_table(table, tiny_bert, folder, {"training": {"epochs": 1}}, "")
    assert static_embedding.packaged(folder).trained
    assert static_embedding.packaged().trained  # the packaged table is the trained one


def test_the_packaged_table_carries_its_notice_and_how_it_was_made():
    import json

    info = json.loads((static_embedding.PACKAGED / "info.json").read_text())
    assert info["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert info["training"]["sentences"] >= 100_000 and "corpus" in info
    notice = (static_embedding.PACKAGED / "NOTICE").read_text()
    assert "Apache License, Version 2.0" in notice and "train_static_table.py" in notice
