"""Train the static token table of all-MiniLM-L6-v2 on real sentences: Model2Vec's "Tokenlearn"
step (Tulkens and van Dongen), which :mod:`metaclaw.skills.static_embedding`'s distillation leaves out.

The distilled table (each token run through MiniLM alone, PCA, SIF weights) is only a starting
point: here its rows are learned so that the weighted sum of a sentence's token rows points where
MiniLM's own sentence embedding of that sentence points, over a corpus of sentences unrelated to
the retrieval benchmark.

1. Corpus: English sentences (4-60 words, mostly words, deduplicated case-insensitively) from
   text on a Debian machine with the ``minilm`` extra installed: the docstrings and comments
   of 4,000 Python files of site-packages (a seeded sample, test folders left out), the package
   descriptions in site-packages' ``*.dist-info/METADATA``, the man pages of
   ``/usr/share/man/man[1-8]`` (groff markup stripped) and the READMEs and text files of
   ``/usr/share/doc``. A seeded sample is drawn: 40% Python docstrings and comments, 35% man
   pages, 20% ``/usr/share/doc``, 5% package descriptions.
2. Teacher: MiniLM encodes each sentence (sentence-transformers, ``normalize_embeddings=True``);
   a progress line is printed and the vectors are cached in ``--work`` (resumed when cut short).
3. Training, in MiniLM's 384-dimensional output space: row ``t`` starts as the token's output
   vector, centred as in :func:`metaclaw.skills.static_embedding.distill`; a sentence's vector is
   ``sum_t w_t row_t`` over its tokens (``w``: :func:`~metaclaw.skills.static_embedding.rarity_weights`,
   function words at 0, kept fixed); the loss is one minus its cosine with the teacher's vector
   (Adam). Tokens that never occur in the corpus keep their starting rows.
4. The learned rows are reduced to :data:`~metaclaw.skills.static_embedding.DIMS` dimensions by PCA
   (the principal axes of the centred rows; the rows themselves are projected without
   centring, so that sums of rows are projected as the model saw them), weighted by ``w`` and
   written as a packaged folder (``table.npz`` int8 rows and scales, ``tokenizer.json``,
   ``info.json``, ``NOTICE``) that :func:`metaclaw.skills.static_embedding.packaged` reads unchanged.

The packaged table (``metaclaw/skills/data/static-minilm``) was written by this script with its
defaults. Sizes and times: see ``RESULTS`` at the end of this docstring.

    python benchmarks/train_static_table.py --out FOLDER [--work DIR] [--sentences N]

Then ``python benchmarks/bench_retrieval.py --static-table FOLDER --tune static`` chooses the
hybrid's constants for the new table on the dev split (a table moves every score: the
constants of another table do not carry over), and ``--static-table FOLDER --split dev``, with
them set as ``HYBRID_CONSTANTS["static"]`` in ``metaclaw/skills/retrieval.py``, says whether it
is better (a table without training in its ``info.json`` is scored with the distilled table's
constants, ``HYBRID_CONSTANTS["distilled"]``).

RESULTS (2026-11-28, two idle cores). Sources found: 854,603 man-page sentences from 22,169
pages (283,758 unique), 131,768 from 1,108 ``/usr/share/doc`` files (93,536 unique), 94,785
from 4,000 Python files (77,348 unique), 8,648 from 255 package descriptions (8,127 unique);
a 150,000-sentence draw, gathered in 37 s. MiniLM encodes about 220 sentences a second (11
minutes); six epochs take 26 s, 14,769 tokens occur in the sentences, and the held-out cosine
with MiniLM's sentence vectors rises from 0.54 (distilled table) to 0.86 (0.77 for the
half-and-half blend written by default). On the retrieval benchmark's dev split, the hybrid's
constants chosen for each table by ``--tune static`` with BM25's ``absent`` held at 35: the
blend gives one-skill hits 73.9%, two-skill 51.7%, precision 75.8% over the four states of the
skills together (87.0 -> 88.5% one-skill in the served library, off-topic 9.9% in both),
against 71.0%, 55.2% and 68.3% for the distilled table; the learned rows alone 73.1%, 51.7%,
75.1%. An earlier run on 14,336 sentences (a loaded machine) gave no more hits.
"""

from __future__ import annotations

import argparse
import ast
import collections
import glob
import gzip
import json
import os
import random
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from metaclaw.skills import static_embedding as se  # noqa: E402
from metaclaw.skills.retrieval import minilm_model_path  # noqa: E402

#: Share of the sample drawn from each kind of source (matched against the source's name).
SHARES = {"python": 0.40, "package": 0.05, "man": 0.35, "/usr/share/doc": 0.20}
SAMPLE_SEED = 20261127
PYFILE_SEED = 29
PYFILES = 4000
TRAIN_SEED = 0

_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]*")
_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(`])")


# -- 1. corpus ---------------------------------------------------------------------------------

def clean_sentences(text: str) -> list[str]:
    """The sentences of ``text`` worth keeping: 4-60 words, at least 70% of them words, at least
    60% letters."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        for s in _SPLIT.split(para):
            s = s.strip(" -*#>|")
            words = s.split()
            if not 4 <= len(words) <= 60:
                continue
            alpha = sum(1 for w in words if _WORD.fullmatch(w.strip(".,;:!?()\"'`")))
            if alpha / len(words) < 0.7:
                continue
            if sum(c.isalpha() for c in s) / len(s) < 0.6:
                continue
            if not re.search(r"[a-z]{3}", s):
                continue
            out.append(s)
    return out


def python_texts(path: str) -> list[str]:
    """Docstrings (doctest and field lines left out) and runs of ``#`` comments of a file."""
    try:
        src = open(path, encoding="utf-8", errors="ignore").read()
    except OSError:
        return []
    if len(src) > 400_000:
        return []
    texts = []
    try:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append("\n".join(
                        line for line in doc.splitlines() if not line.strip().startswith(
                            (">>>", "...", ":param", ":type", ":return", ":rtype"))))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        pass
    comments: list[str] = []
    for line in src.splitlines():
        st = line.strip()
        if st.startswith("#") and not st.startswith(("#!", "# -*-", "#:", "# type:", "# noqa",
                                                     "# pragma")):
            comments.append(st.lstrip("# "))
        elif comments:
            texts.append(" ".join(comments))
            comments = []
    if comments:
        texts.append(" ".join(comments))
    return texts


_GROFF = [(re.compile(r"\\f\[[A-Z]*\]|\\f[BIRPC]|\\f\([A-Z]{2}"), ""),
          (re.compile(r"\\\((..)"), " "), (re.compile(r"\\\[[^\]]*\]"), " "),
          (re.compile(r"\\[-e]"), "-"), (re.compile(r"\\&|\\c|\\:|\\/|\\,"), ""),
          (re.compile(r"\\s[-+]?\d"), ""), (re.compile(r"\\\*\(?..|\\\*\[[^\]]*\]"), ""),
          (re.compile(r"\\ |\\~"), " "), (re.compile(r'\\"'), "")]
_BREAKS = {"PP", "LP", "P", "SH", "SS", "TP", "IP", "sp", "br", "HP", "RS", "RE", "nf", "fi",
           "TH", "Sh", "Pp", "Bl", "El", "It"}
_HEADINGS = {"SH", "SS", "TH", "Sh", "IP", "It"}
_FONTS = {"B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM", "Nm", "Ar", "Fl", "Em", "Pa", "Cm",
          "Xr"}


def _read_text(path: str) -> str:
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rt", errors="ignore").read()
        return open(path, errors="ignore").read()
    except (OSError, EOFError):
        return ""


def man_text(path: str) -> str:
    """The running text of a man page: requests dropped (font requests keep their words),
    escapes stripped."""
    raw = _read_text(path)
    if raw.startswith(".so "):
        return ""
    lines = []
    for line in raw.splitlines():
        if line.startswith(("'\\\"", ".\\\"")):
            continue
        if line.startswith((".", "'")):
            m = re.match(r"[.'](\w+)\s*(.*)", line)
            if not m:
                continue
            macro, arg = m.groups()
            if macro in _BREAKS:
                lines.append("")
                if macro in _HEADINGS:
                    continue
            if macro in _FONTS:
                lines.append(arg.replace('"', ""))
            continue
        lines.append(line)
    text = "\n".join(lines)
    for pattern, repl in _GROFF:
        text = pattern.sub(repl, text)
    return text.replace("\\", "")


def markup_text(raw: str, *, tags: bool = False) -> str:
    """Markdown / reStructuredText with code blocks, link targets and heading lines removed
    (and HTML tags, with ``tags``)."""
    raw = re.sub(r"```.*?```", "\n\n", raw, flags=re.S)
    raw = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    if tags:
        raw = re.sub(r"<[^>]+>", " ", raw)
    raw = re.sub(r"^[=\-~^#*]{3,}\s*$", "", raw, flags=re.M)
    return re.sub(r"^\s*(#+|\.\.)\s.*$", "\n", raw, flags=re.M)


def gather() -> dict[str, list[str]]:
    """All sentences, per source (in a fixed order)."""
    warnings.filterwarnings("ignore")  # invalid escapes in old docstrings
    site = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages")))[0]
    sources = {}
    metas = sorted(glob.glob(f"{site}/*.dist-info/METADATA"))
    sources[f"package descriptions (site-packages METADATA, {len(metas)} packages)"] = [
        s for p in metas for s in clean_sentences(markup_text(
            _read_text(p).partition("\n\n")[2], tags=True))]
    mans = sorted(glob.glob("/usr/share/man/man[1-8]/*"))
    sources[f"man pages (/usr/share/man sections 1-8, {len(mans)} pages)"] = [
        s for p in mans for s in clean_sentences(man_text(p))]
    docs = sorted(p for p in glob.glob("/usr/share/doc/**/*", recursive=True)
                  if os.path.isfile(p)
                  and re.search(r"(readme|\.md|\.txt|\.rst|news|faq)(\.gz)?$", p, re.I)
                  and "copyright" not in p.lower() and "changelog" not in p.lower())
    sources[f"/usr/share/doc READMEs and text docs ({len(docs)} files)"] = [
        s for p in docs for s in clean_sentences(markup_text(_read_text(p)[:500_000]))]
    pyfiles = [p for p in sorted(glob.glob(f"{site}/**/*.py", recursive=True))
               if "/tests/" not in p and "/test/" not in p and "metaclaw" not in p
               and os.path.getsize(p) < 150_000]
    random.Random(PYFILE_SEED).shuffle(pyfiles)
    pyfiles = sorted(pyfiles[:PYFILES])
    sources[f"python docstrings and comments (site-packages, {len(pyfiles)} files)"] = [
        s for p in pyfiles for t in python_texts(p) for s in clean_sentences(t)]
    return sources


def sample(sources: dict[str, list[str]], total: int) -> tuple[list[str], dict]:
    """A seeded sample of ``total`` sentences (deduplicated across sources, :data:`SHARES`),
    and per source (found, unique, taken)."""
    rng = random.Random(SAMPLE_SEED)
    seen: set[str] = set()
    picked: list[str] = []
    counts = collections.OrderedDict()
    for name, sentences in sources.items():
        unique = []
        for s in sentences:
            key = " ".join(s.lower().split())
            if key not in seen:
                seen.add(key)
                unique.append(s)
        share = next(v for k, v in SHARES.items() if name.startswith(k) or k in name)
        rng.shuffle(unique)
        taken = unique[:int(total * share)]
        counts[name] = (len(sentences), len(unique), len(taken))
        picked += taken
    rng.shuffle(picked)
    return picked, counts


# -- 2. teacher --------------------------------------------------------------------------------

def encode(sentences: list[str], path: Path, chunk: int = 2048) -> np.ndarray:
    """MiniLM's unit vectors of ``sentences`` (float16), cached in ``path`` after every chunk;
    a cut-short run goes on where it stopped."""
    from sentence_transformers import SentenceTransformer

    done = np.load(path) if path.is_file() else np.zeros((0, 384), np.float16)
    if len(done) >= len(sentences):
        return done[:len(sentences)]
    model = SentenceTransformer(str(minilm_model_path()), device="cpu")
    out = np.zeros((len(sentences), 384), np.float16)
    out[:len(done)] = done
    start = time.time()
    for k in range(len(done), len(sentences), chunk):
        part = sentences[k:k + chunk]
        out[k:k + len(part)] = model.encode(part, batch_size=64, normalize_embeddings=True,
                                            convert_to_numpy=True)
        n = k + len(part)
        staging = path.with_suffix(".part.npy")
        np.save(staging, out[:n])
        os.replace(staging, path)
        rate = (n - len(done)) / (time.time() - start)
        print(f"encoded {n:,}/{len(sentences):,} sentences ({rate:.1f}/s, "
              f"{(len(sentences) - n) / rate / 60:.0f} min left)", flush=True)
    return out


# -- 3. training -------------------------------------------------------------------------------

def token_outputs(model_path: Path) -> np.ndarray:
    """Each vocabulary token's output vector, run through the model alone (as in
    :func:`metaclaw.skills.static_embedding.distill`)."""
    import torch
    from transformers import AutoModel

    tokenizer = se._tokenizer(model_path)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    model = AutoModel.from_pretrained(str(model_path)).eval()
    vocab = tokenizer.get_vocab_size()
    hidden = np.zeros((vocab, model.config.hidden_size), dtype=np.float32)
    ids = torch.arange(vocab)
    with torch.inference_mode():
        for start in range(0, vocab, 1024):
            token = ids[start:start + 1024]
            batch = torch.stack([torch.full_like(token, cls_id), token,
                                 torch.full_like(token, sep_id)], dim=1)
            out = model(input_ids=batch, attention_mask=torch.ones_like(batch))
            hidden[start:start + len(token)] = out.last_hidden_state[:, 1].float().numpy()
    return hidden


def train(sentences: list[str], teacher: np.ndarray, hidden: np.ndarray, tokenizer, *,
          epochs: int, lr: float, blend: float = 1.0,
          batch: int = 512) -> tuple[np.ndarray, dict]:
    """Learned rows (``vocab x hidden``, before PCA and weighting; ``blend`` of the learned
    rows and ``1 - blend`` of the starting ones) and a summary."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(TRAIN_SEED)
    rng = np.random.default_rng(TRAIN_SEED)
    encodings = tokenizer.encode_batch(sentences, add_special_tokens=False)
    keep = [i for i, e in enumerate(encodings) if e.ids]
    ids = [np.asarray(encodings[i].ids, dtype=np.int64) for i in keep]
    target = torch.tensor(teacher[keep].astype(np.float32))
    order = rng.permutation(len(ids))
    n_val = max(1000, len(ids) // 20)
    val, fit = order[:n_val], order[n_val:]
    start_rows = torch.tensor(hidden - hidden.mean(axis=0))
    weights = torch.tensor(se.rarity_weights(tokenizer))
    rows = torch.nn.Parameter(start_rows.clone())
    optimizer = torch.optim.SparseAdam([rows], lr=lr)  # a batch touches few rows

    def pooled(table, chosen):
        flat = torch.tensor(np.concatenate([ids[i] for i in chosen]))
        offsets = torch.tensor(np.cumsum([0] + [len(ids[i]) for i in chosen[:-1]]))
        return F.embedding_bag(flat, table, offsets, mode="sum",
                               per_sample_weights=weights[flat], sparse=True)

    @torch.no_grad()
    def held_out(table) -> float:
        return float(torch.cat([F.cosine_similarity(pooled(table, val[k:k + 4096]),
                                                    target[val[k:k + 4096]], dim=1)
                                for k in range(0, len(val), 4096)]).mean())

    seen = np.zeros(len(hidden), dtype=bool)
    seen[np.concatenate([ids[i] for i in fit])] = True
    summary = {"sentences": len(ids), "held_out": int(n_val), "tokens_seen": int(seen.sum()),
               "held_out_cosine_before": round(held_out(start_rows), 4)}
    print(f"training on {len(fit):,} sentences ({n_val:,} held out), {seen.sum():,} of "
          f"{len(hidden):,} tokens seen; held-out cosine with MiniLM before: "
          f"{summary['held_out_cosine_before']:.4f}", flush=True)
    start = time.time()
    for epoch in range(epochs):
        shuffled = rng.permutation(fit)
        for k in range(0, len(fit), batch):
            part = shuffled[k:k + batch]
            loss = (1 - F.cosine_similarity(pooled(rows, part), target[part], dim=1)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch + 1}/{epochs}: held-out cosine {held_out(rows.detach()):.4f} "
              f"({time.time() - start:.0f} s)", flush=True)
    summary["held_out_cosine_after"] = round(held_out(rows.detach()), 4)
    summary["train_seconds"] = round(time.time() - start)
    learned = rows.detach().numpy()
    if blend < 1:  # halfway back towards the distilled rows
        learned = blend * learned + (1 - blend) * start_rows.numpy()
        summary["held_out_cosine_blended"] = round(held_out(torch.tensor(learned)), 4)
    return learned, summary


def finish(rows: np.ndarray, tokenizer) -> np.ndarray:
    """PCA to :data:`DIMS` (axes of the centred rows, rows projected uncentred), then the
    rarity weights: the table :class:`~metaclaw.skills.static_embedding.StaticEmbedding` takes."""
    centred = rows - rows.mean(axis=0)
    _, eigenvectors = np.linalg.eigh(centred.T.astype(np.float64) @ centred)
    components = eigenvectors[:, ::-1][:, :se.DIMS].astype(np.float32)
    return ((rows @ components) * se.rarity_weights(tokenizer)[:, None]).astype(np.float32)


NOTICE = """The files in this folder are derived from all-MiniLM-L6-v2
(https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2), Copyright the
sentence-transformers authors, licensed under the Apache License, Version 2.0
(https://www.apache.org/licenses/LICENSE-2.0).

- tokenizer.json is the model's tokenizer, unchanged.
- table.npz is derived from the model's weights: every vocabulary token was run through the
  model alone, and the rows were then trained so that the rarity-weighted sum of a sentence's
  token rows matches the model's embedding of that sentence (Model2Vec's Tokenlearn step), on
  {used:,} English sentences (5% of them held out to measure it) drawn from {corpus}.
  The rows were reduced to 256 dimensions by PCA, weighted by token rarity (SIF, function words
  at 0) and quantized to int8 with one scale per row
  (benchmarks/train_static_table.py).

These derived files are distributed under the same Apache License, Version 2.0.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the packaged folder to write")
    parser.add_argument("--work", type=Path, default=Path("train-static-work"),
                        help="where the corpus, teacher vectors and token outputs are cached")
    parser.add_argument("--sentences", type=int, default=SENTENCES,
                        help="sentences drawn (MiniLM encodes them; that is most of the time)")
    parser.add_argument("--use", type=int, default=0,
                        help="train on the first N drawn sentences only (0: all)")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--blend", type=float, default=BLEND,
                        help="share of the learned rows in the table (the rest: distilled rows)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.work.mkdir(parents=True, exist_ok=True)
    model_path = Path(minilm_model_path())
    tokenizer = se._tokenizer(model_path)
    tokenizer.no_padding()
    tokenizer.no_truncation()

    corpus_file = args.work / f"corpus-{args.sentences}.json"
    if corpus_file.is_file():
        record = json.loads(corpus_file.read_text())
    else:
        start = time.time()
        sentences, counts = sample(gather(), args.sentences)
        record = {"sentences": sentences, "counts": counts}
        corpus_file.write_text(json.dumps(record))
        print(f"corpus: {len(sentences):,} sentences in {time.time() - start:.0f} s", flush=True)
    sentences, counts = record["sentences"], record["counts"]
    for name, (found, unique, taken) in counts.items():
        print(f"  {name}: {found:,} sentences, {unique:,} unique, {taken:,} drawn")
    if args.use:  # the first N only (the sample is shuffled): the rest is not encoded
        sentences = sentences[:args.use]
    teacher = encode(sentences, args.work / f"teacher-{args.sentences}.npy")
    hidden_file = args.work / "token-outputs.npy"
    if not hidden_file.is_file():
        np.save(hidden_file, token_outputs(model_path))
    rows, summary = train(sentences, teacher, np.load(hidden_file), tokenizer,
                          epochs=args.epochs, lr=args.lr, blend=args.blend)
    info = {
        "model": "sentence-transformers/all-MiniLM-L6-v2", "recipe": RECIPE, "dims": se.DIMS,
        "quantization": "int8 per row (row = rows * scale)",
        "training": {"epochs": args.epochs, "lr": args.lr, "blend": args.blend, **summary},
        "corpus": {name: dict(zip(("found", "unique", "drawn"), counts[name]))
                   for name in counts},
        "sentences_used": f"the first {len(sentences):,} of the "
                          f"{sum(c[2] for c in counts.values()):,} drawn (shuffled)"}
    notice = NOTICE.format(corpus="; ".join(info["corpus"]), used=info["training"]["sentences"])
    se.write_table(finish(rows, tokenizer), model_path, args.out, info, notice)
    print(f"wrote {args.out}")


SENTENCES = 150_000
EPOCHS = 6
LR = 0.01
BLEND = 0.5
RECIPE = se.RECIPE.replace("-v2", "") + "-tokenlearn-v1"

if __name__ == "__main__":
    main()
