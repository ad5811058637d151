"""Sentences as typed dependency triplets (R, w1, w2), the sentence fragments of the model.

``ParsedSentence`` is what a parser gives (model/parsers.py: spaCy or stanza, one output format);
``sentence_triplets`` also gives the paper's BoW and bigram ablations, and ``RelationVocab`` applies
the paper's rule that relation types under 1 % of all training relations are dropped.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

FRAGMENT_MODES = ("dependency", "bow", "bigram", "tree")

# Relations whose dependent English puts before its head ("a black dog": amod(dog, black), det(dog, a);
# "dog jumps": nsubj(jumps, dog)); every other relation reads head first ("throws ball", "runs in grass").
DEPENDENT_FIRST = frozenset({"nsubj", "nsubjpass", "csubj", "csubjpass", "expl", "amod", "det", "predet", "compound",
                             "nn", "nummod", "num", "quantmod", "poss", "aux", "auxpass", "neg", "mark", "preconj",
                             "intj"})


@dataclass(frozen=True)
class Triplet:
    """One sentence fragment: relation ``rel`` from head word ``w1`` to dependent ``w2`` (lower-case)."""

    rel: str
    w1: str
    w2: str

    def text(self) -> str:
        """Readable form, e.g. ``prep_in(runs, grass)``; a lone word as itself, the whole sentence as
        ``<sentence>``."""
        if self.rel == "<word>":
            return self.w1
        if self.rel == "<sentence>":
            return "<sentence>"
        return f"{self.rel}({self.w1}, {self.w2})"

    def phrase(self) -> str:
        """The fragment as words, in the order English usually puts them: ``nsubj(jumps, dog)`` reads
        "dog jumps", ``amod(dog, black)`` "black dog", ``prep_in(runs, grass)`` "runs in grass",
        ``dobj(throws, ball)`` "throws ball", ``conj(dog, cat)`` "dog, cat"; a lone word as itself,
        the whole-sentence fragment as "whole sentence". Display only (the model reads the triplet)."""
        if self.rel == "<sentence>":
            return "whole sentence"
        if self.rel in ("<word>", "") or not self.w2:
            return self.w1
        for prefix in ("prep_", "prepc_"):
            if self.rel.startswith(prefix):
                return f"{self.w1} {self.rel[len(prefix):].replace('_', ' ')} {self.w2}"
        if self.rel == "agent":
            return f"{self.w1} by {self.w2}"
        if self.rel == "conj":
            return f"{self.w1}, {self.w2}"
        if self.rel in DEPENDENT_FIRST:
            return f"{self.w2} {self.w1}"
        return f"{self.w1} {self.w2}"

    def to_list(self) -> list[str]:
        return [self.rel, self.w1, self.w2]

    @classmethod
    def from_list(cls, items: Sequence[str]) -> Triplet:
        rel, w1, w2 = items
        return cls(str(rel), str(w1), str(w2))


@dataclass(frozen=True)
class ParsedSentence:
    """A parsed caption: lower-case word tokens (no punctuation), its dependency triplets, and the tree.

    ``heads[i]`` is the index in ``tokens`` of token i's head (-1 for a root), ``labels[i]`` its
    relation to it: the collapsed tree the triplets are edges of (``prep_in(runs, grass)``), every
    token a node; a collapsed preposition hangs below its object as ``case`` (as in Universal
    Dependencies), a root is labelled ``ROOT``. Empty when the parser gave no tree.
    """

    tokens: tuple[str, ...]
    triplets: tuple[Triplet, ...]
    heads: tuple[int, ...] = ()
    labels: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "triplets": [t.to_list() for t in self.triplets],
                "heads": list(self.heads), "labels": list(self.labels)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParsedSentence:
        return cls(
            tokens=tuple(str(t) for t in data["tokens"]),
            triplets=tuple(Triplet.from_list(t) for t in data["triplets"]),
            heads=tuple(int(h) for h in data.get("heads", ())),
            labels=tuple(str(x) for x in data.get("labels", ())),
        )

    def tree_edges(self) -> list[Triplet]:
        """Every edge of the tree as a triplet (label, head word, word); roots have none."""
        return [Triplet(self.labels[i], self.tokens[h], self.tokens[i]) for i, h in enumerate(self.heads) if h >= 0]


class Parser(Protocol):
    """Anything that turns captions into ``ParsedSentence`` objects, one per caption, in order.

    ``version`` names what decides the parses besides the text: the library's and the parser model's
    versions and the word cut-off (the parse cache is keyed by it)."""

    name: str

    @property
    def version(self) -> str: ...

    def parse(self, sentences: Sequence[str]) -> list[ParsedSentence]: ...


# ------------------------------------------------------------------------------ fragments, vocab


def sentence_triplets(parsed: ParsedSentence, mode: str) -> list[Triplet]:
    """The sentence's fragments: "dependency" triplets, "bow" words (w1 = w2) or adjacent "bigram"s;
    "tree" (the global sentence encoders): every edge of the collapsed tree, the relations they compose over."""
    if mode == "dependency":
        return list(parsed.triplets)
    if mode == "tree":
        return parsed.tree_edges()
    if mode == "bow":
        return [Triplet("word", w, w) for w in parsed.tokens]
    if mode == "bigram":
        toks = parsed.tokens
        if len(toks) == 1:
            return [Triplet("bigram", toks[0], toks[0])]
        return [Triplet("bigram", a, b) for a, b in zip(toks[:-1], toks[1:], strict=True)]
    raise ValueError(f"unknown fragment mode {mode!r}; choose one of {', '.join(FRAGMENT_MODES)}")


class RelationVocab:
    """The relation types kept for training (one weight matrix each), most frequent first."""

    def __init__(
        self, kept: Sequence[str], counts: dict[str, int] | None = None, cutoff: float = 0.0
    ) -> None:
        self.kept: tuple[str, ...] = tuple(kept)
        self.counts: dict[str, int] = dict(counts or {})
        self.cutoff = cutoff
        self._index = {rel: i for i, rel in enumerate(self.kept)}

    @classmethod
    def fit(cls, triplet_lists: Iterable[Sequence[Triplet]], cutoff: float) -> RelationVocab:
        """Keep the relation types whose share of all relations seen is >= ``cutoff`` (paper: 1 %)."""
        counts: Counter[str] = Counter()
        for triplets in triplet_lists:
            counts.update(t.rel for t in triplets)
        total = sum(counts.values())
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        kept = [rel for rel, n in ranked if total > 0 and n / total >= cutoff]
        vocab = cls(kept, dict(ranked), cutoff)
        log.info(
            "relation types: %d seen, %d kept at cut-off %.3g (%.1f%% of %d relations covered)",
            len(counts),
            len(kept),
            cutoff,
            100.0 * vocab.coverage,
            total,
        )
        return vocab

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def dropped(self) -> tuple[str, ...]:
        """Relation types seen in training but under the cut-off."""
        return tuple(rel for rel in self.counts if rel not in self._index)

    @property
    def coverage(self) -> float:
        """Share of training relations whose type is kept."""
        total = self.total
        return sum(self.counts.get(r, 0) for r in self.kept) / total if total else 0.0

    def index(self, rel: str) -> int | None:
        return self._index.get(rel)

    def __len__(self) -> int:
        return len(self.kept)

    def __contains__(self, rel: object) -> bool:
        return rel in self._index

    def to_dict(self) -> dict[str, Any]:
        return {"kept": list(self.kept), "counts": dict(self.counts), "cutoff": self.cutoff}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RelationVocab:
        counts = {str(k): int(v) for k, v in data.get("counts", {}).items()}
        return cls([str(r) for r in data["kept"]], counts, float(data.get("cutoff", 0.0)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RelationVocab):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.kept)

    def __repr__(self) -> str:
        return f"RelationVocab(kept={len(self.kept)}, seen={len(self.counts)}, cutoff={self.cutoff})"
