"""Static token embeddings distilled from a sentence-transformers model: text vectors without
running the model.

The recipe is Model2Vec's (Tulkens and van Dongen, 2024), without its training step:

1. every token of the model's vocabulary is run through the model once, alone between
   ``[CLS]`` and ``[SEP]``, and its output vector is kept (``vocab x hidden``);
2. the table is centred and reduced to :data:`DIMS` dimensions by PCA;
3. each row is weighted by how rare its token is, SIF-style (Arora et al., 2017): WordPiece ids
   of whole words are roughly in order of frequency, so a token of frequency rank ``r`` (its id
   less the ids before the first word) weighs ``r / (r + SIF_A)``, and function words (the
   :data:`STOPWORDS`) weigh nothing. This weighting was chosen over the earlier
   ``log(1 + token id)`` on the dev split of the retrieval benchmark (``benchmarks/
   bench_retrieval.py``): frequent tokens ("the", "to", "please") no longer pull every text
   towards every other.

A text's vector is the mean of its tokens' rows, normalized to unit length. Encoding a query is
one tokenizer call and a gather over a few dozen rows (tens of microseconds; no torch), and its
cost does not grow with model depth, which is why retrieval uses it by default.

The table of all-MiniLM-L6-v2 ships with the package (:data:`PACKAGED`: the table quantized to int8
with one scale per row, 6.9 MB, and the model's tokenizer; :func:`packaged`): the default
embeddings need neither torch nor a distillation, only numpy and tokenizers, and load in a fraction
of a second. That table went one step further than the recipe above, Model2Vec's "Tokenlearn" step:
its rows were trained so that the weighted sum of a sentence's token rows points where MiniLM's own
embedding of that sentence points, on 142,500 English sentences of technical text (man pages,
package documentation, Python docstrings; none from the retrieval benchmark), raising the mean
cosine with MiniLM's sentence vectors on 7,500 held-out sentences from 0.54 to 0.77 (half learned
rows, half distilled, before PCA; the details are in its ``info.json`` and ``NOTICE``). ``python
benchmarks/train_static_table.py --out FOLDER`` writes such a folder (it needs the ``minilm``
extra; the sentences are drawn from the machine's own man pages and packages, so another machine's
table differs slightly); ``python benchmarks/bench_retrieval.py --static-table FOLDER`` measures
it.

For any other model the table is derived once per model and cached on disk, keyed by the model's files (30,522 x 256
float16: 16 MB for all-MiniLM-L6-v2, under ``~/.cache/metaclaw/static-embeddings``). Deriving it
runs the model over its vocabulary once per machine: about 70 CPU-seconds and 0.9 GB of peak
memory for all-MiniLM-L6-v2 (30-60 s on two idle cores, minutes on a loaded machine); concurrent
processes wait for one another instead of deriving it twice. A cached table that cannot be read
is derived again; where no cache folder is writable the table is derived in memory at every
start (set ``METACLAW_CACHE_DIR``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from metaclaw.fileio import atomic_write, private_temp_dir

#: Dimensions kept by PCA.
DIMS = 256
#: Bumped when the recipe changes, so that older cached tables are not reused.
RECIPE = "model2vec-token-output-pca-sif30-stopwords-v2"
#: The SIF constant of the rarity weighting (in frequency ranks).
SIF_A = 30.0
#: Tokens that weigh nothing: English function words (the lexical retriever's stopwords).
STOPWORDS = frozenset("""
a an and are as at be been but by can could did do does for from had has have how i if in into is
it its me my of on or our please so than that the their them then there these this those to too
up us was we were what when where which while who why will with would you your yours
""".split())

log = logging.getLogger(__name__)

#: The packaged table of all-MiniLM-L6-v2 (Apache-2.0: its notice is in the folder).
PACKAGED = Path(__file__).resolve().parent / "data" / "static-minilm"


class StaticEmbedding:
    """A token -> vector table and the tokenizer that produced the token ids.

    ``table``: float32 array ``vocab x dims`` (already rarity-weighted); ``tokenizer``: a
    ``tokenizers.Tokenizer`` (padding and truncation are turned off here).
    """

    def __init__(self, table: Any, tokenizer: Any, *, source: str = "", trained: bool = False):
        import numpy as np

        self.table = np.ascontiguousarray(table, dtype=np.float32)
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.tokenizer = tokenizer
        self.source = source
        #: rows trained towards the model's sentence vectors (the packaged table; its
        #: ``info.json`` says so), not only distilled: retrieval's constants differ
        self.trained = trained

    @property
    def dim(self) -> int:
        return int(self.table.shape[1])

    def __repr__(self) -> str:
        return f"StaticEmbedding({self.source or 'table'}, {self.table.shape[0]} x {self.dim})"

    def encode_one(self, text: str):
        """The unit-length vector of ``text`` (zeros when it has no tokens)."""
        import numpy as np

        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            return np.zeros(self.dim, dtype=np.float32)
        vector = self.table[ids].sum(axis=0)
        norm = float(np.linalg.norm(vector))
        return vector / norm if norm > 0 else vector

    def encode(self, texts: Sequence[str]):
        """Unit-length vectors of ``texts``, as a float32 array ``len(texts) x dims``."""
        import numpy as np

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, encoding in enumerate(self.tokenizer.encode_batch(list(texts),
                                                                   add_special_tokens=False)):
            if encoding.ids:
                vector = self.table[encoding.ids].sum(axis=0)
                norm = float(np.linalg.norm(vector))
                out[row] = vector / norm if norm > 0 else vector
        return out


def _tokenizer(model_path: Path) -> Any:
    from tokenizers import Tokenizer

    path = model_path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_path} has no tokenizer.json: a static table needs the "
                                "model's fast tokenizer")
    return Tokenizer.from_file(str(path))


def rarity_weights(tokenizer: Any):
    """Each token's weight (float32, one per id): ``r / (r + SIF_A)`` for frequency rank ``r``
    (ids counted from the first whole-word token, ``"the"`` in BERT's vocabulary; 1 at least),
    0 for :data:`STOPWORDS`."""
    import numpy as np

    vocab = tokenizer.get_vocab_size()
    first = tokenizer.token_to_id("the") or 0
    rank = np.maximum(np.arange(vocab, dtype=np.float32) - first, 1.0)
    weights = rank / (rank + SIF_A)
    for word in STOPWORDS:
        token = tokenizer.token_to_id(word)
        if token is not None:
            weights[token] = 0.0
    return weights.astype(np.float32)


def distill(model_path: str | os.PathLike, *, dims: int = DIMS, batch_size: int = 1024):
    """The rarity-weighted PCA table (float32, ``vocab x dims``) of the transformer in
    ``model_path`` (a sentence-transformers or Hugging Face BERT-style folder). Needs torch and
    transformers; runs the model over the whole vocabulary once."""
    import numpy as np
    import torch
    from transformers import AutoModel

    model_path = Path(model_path)
    tokenizer = _tokenizer(model_path)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    if cls_id is None or sep_id is None:
        raise ValueError(f"{model_path}: the tokenizer has no [CLS]/[SEP] tokens (BERT-style "
                         "models only)")
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no weight-loading bar on stderr
    try:
        model = AutoModel.from_pretrained(str(model_path)).eval()
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    vocab = tokenizer.get_vocab_size()
    hidden = np.zeros((vocab, model.config.hidden_size), dtype=np.float32)
    ids = torch.arange(vocab)
    with torch.inference_mode():
        for start in range(0, vocab, batch_size):
            token = ids[start:start + batch_size]
            batch = torch.stack([torch.full_like(token, cls_id), token,
                                 torch.full_like(token, sep_id)], dim=1)
            out = model(input_ids=batch, attention_mask=torch.ones_like(batch)).last_hidden_state
            hidden[start:start + len(token)] = out[:, 1].float().numpy()
    centred = hidden - hidden.mean(axis=0)
    dims = min(dims, centred.shape[1])
    _, eigenvectors = np.linalg.eigh(centred.T.astype(np.float64) @ centred)
    components = eigenvectors[:, ::-1][:, :dims]  # largest variance first
    table = centred @ components.astype(np.float32)
    table *= rarity_weights(tokenizer)[:, None]
    return table.astype(np.float32)


def cache_key(model_path: str | os.PathLike, dims: int = DIMS) -> str:
    """Identifies a table: the recipe, ``dims``, the model's config and tokenizer contents, and
    the size and modification time of its weights."""
    model_path = Path(model_path)
    digest = hashlib.sha256(f"{RECIPE}\0{dims}".encode())
    for name in ("config.json", "tokenizer.json"):
        path = model_path / name
        digest.update(path.read_bytes() if path.is_file() else b"-")
    for weights in sorted(model_path.glob("*.safetensors")) + sorted(model_path.glob("*.bin")):
        stat = weights.stat()
        digest.update(f"{weights.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def _configured_dir() -> Path:
    root = os.environ.get("METACLAW_CACHE_DIR")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or
                                        Path.home() / ".cache") / "metaclaw"
    return base / "static-embeddings"


def _temp_dir() -> Path | None:
    # a folder of this user's own: a shared name could be created (or filled) first by someone
    # else (None where it cannot be had so)
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    own = private_temp_dir(f"metaclaw-cache-{user}")
    return None if own is None else own / "static-embeddings"


def cache_dir() -> Path | None:
    """Where tables are kept: ``$METACLAW_CACHE_DIR/static-embeddings``, else
    ``~/.cache/metaclaw/static-embeddings`` (``$XDG_CACHE_HOME`` when set), else the temp folder's
    ``metaclaw-cache-<uid>/static-embeddings``; ``None`` when none of them is writable. (A table
    already in the first, even read-only as in a prepared image, is used by :func:`load`.)"""
    for target in (_configured_dir(), _temp_dir()):
        if target is None:
            continue
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(target, os.W_OK):
            return target
    return None


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``lock_path`` (none where the lock file cannot be created:
    then nothing can be cached there either)."""
    from filelock import FileLock

    lock = FileLock(lock_path)
    try:
        lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _read(path: Path, vocab: int, dims: int, *, warn: bool = True) -> Any:
    """The cached table at ``path``, or ``None`` when it is missing or unusable (cut short,
    not an array, not ``vocab`` rows of at most ``dims``): such a table is derived again rather
    than failing every query."""
    import numpy as np

    try:
        table = np.load(path)
    except (FileNotFoundError, NotADirectoryError):  # not cached (or cannot be)
        return None
    except (OSError, ValueError, EOFError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    else:
        if table.ndim == 2 and table.shape[0] == vocab and 0 < table.shape[1] <= dims:
            return table  # fewer columns than dims: the model is narrower than dims
        reason = f"shape {table.shape}, expected {vocab} rows of at most {dims}"
    if warn:
        log.warning("the cached static embedding table %s is unusable (%s); deriving it again",
                    path, reason)
    return None


def _save(table: Any, folder: Path, key: str, info: dict[str, Any]) -> None:
    """Writes ``table`` as ``<key>.npy`` in ``folder`` atomically (a reader never sees a partial
    file); where it cannot, says so and what to set instead."""
    import numpy as np

    try:
        with atomic_write(folder / f"{key}.npy", "wb") as handle:
            np.save(handle, table)
        (folder / f"{key}.json").write_text(json.dumps(info))
    except OSError as exc:
        log.warning("cannot cache the static embedding table in %s (%s: %s); it is derived "
                    "again at every start: set METACLAW_CACHE_DIR to a writable folder",
                    folder, type(exc).__name__, exc)


def load(model_path: str | os.PathLike, *, dims: int = DIMS,
         directory: str | os.PathLike | None = None) -> StaticEmbedding:
    """The static embedding of the model in ``model_path``: read from the cache, or distilled
    (:func:`distill`) and cached first. ``directory``: the cache folder (default
    :func:`cache_dir`). Where no folder is writable the table is distilled in memory only, with
    a warning."""
    import numpy as np

    model_path = Path(model_path)
    tokenizer = _tokenizer(model_path)
    key = cache_key(model_path, dims)
    vocab = tokenizer.get_vocab_size()
    if directory is None:  # a table prepared in the configured folder serves even read-only
        prepared = _configured_dir() / f"{key}.npy"
        table = _read(prepared, vocab, dims, warn=False) if prepared.is_file() else None
        if table is not None:
            return StaticEmbedding(table, tokenizer, source=str(model_path))
    folder = Path(directory) if directory is not None else (cache_dir() or _configured_dir())
    with contextlib.suppress(OSError):  # unwritable: _save says what to do
        folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.npy"
    table = _read(path, vocab, dims)
    if table is None:
        with _exclusive(folder / f"{key}.lock"):
            # another process may have finished it while we waited
            table = _read(path, vocab, dims, warn=False)
            if table is None:
                table = distill(model_path, dims=dims).astype(np.float16)
                _save(table, folder, key,
                      {"source": str(model_path), "recipe": RECIPE, "dims": dims})
    return StaticEmbedding(table, tokenizer, source=str(model_path))


def quantize(table: Any) -> tuple[Any, Any]:
    """``table`` (float, ``vocab x dims``) as int8 rows and one float32 scale per row: a row is
    ``int8_row * scale``, each value within half a step (1/254 of the row's largest value)."""
    import numpy as np

    table = np.asarray(table, dtype=np.float32)
    scale = np.abs(table).max(axis=1) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    return np.rint(table / safe[:, None]).astype(np.int8), scale.astype(np.float32)


def packaged(folder: str | os.PathLike = PACKAGED) -> StaticEmbedding | None:
    """The table that ships with the package (all-MiniLM-L6-v2's), or ``None`` when its files
    are missing or unreadable (then :func:`load` derives one from the model)."""
    import numpy as np

    folder = Path(folder)
    try:
        with np.load(folder / "table.npz") as data:
            table = data["rows"].astype(np.float32) * data["scale"][:, None]
        tokenizer = _tokenizer(folder)
    except (OSError, ValueError, KeyError, EOFError) as exc:
        log.warning("the packaged static embedding table in %s is unusable (%s: %s)", folder,
                    type(exc).__name__, exc)
        return None
    if tokenizer.get_vocab_size() != table.shape[0]:
        log.warning("the packaged static embedding table in %s does not match its tokenizer "
                    "(%d rows, %d tokens)", folder, table.shape[0], tokenizer.get_vocab_size())
        return None
    try:
        trained = "training" in json.loads((folder / "info.json").read_text())
    except (OSError, ValueError, TypeError):  # no readable info: taken for a distilled table
        trained = False
    return StaticEmbedding(table, tokenizer, trained=trained,
                           source=f"packaged all-MiniLM-L6-v2 ({folder.name})")


def write_table(table: Any, model_path: str | os.PathLike, folder: str | os.PathLike,
                info: dict[str, Any], notice: str) -> Path:
    """Write ``table`` (float, ``vocab x dims``, already weighted) as a folder :func:`packaged`
    reads: ``table.npz`` (int8 rows and scales, :func:`quantize`), the model's
    ``tokenizer.json``, ``info.json`` (``info``) and ``NOTICE`` (``notice``)."""
    import numpy as np

    model_path, folder = Path(model_path), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows, scale = quantize(table)
    np.savez_compressed(folder / "table.npz", rows=rows, scale=scale)
    (folder / "tokenizer.json").write_bytes((model_path / "tokenizer.json").read_bytes())
    (folder / "info.json").write_text(json.dumps(info, indent=1) + "\n")
    (folder / "NOTICE").write_text(notice)
    return folder
