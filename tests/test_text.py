"""Sentence → triplet conversion: spaCy parse, stanza UD conversion, fragment modes, relation vocab."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from fragsearch.model.fragments import parse_cached
from fragsearch.model.parsers import SpacyParser, StanzaParser, make_parser, shares, stanza_document_to_parsed
from fragsearch.model.text import ParsedSentence, RelationVocab, Triplet, sentence_triplets


@pytest.fixture(scope="module")
def spacy_parser() -> SpacyParser:
    return SpacyParser(max_words=64)


def _texts(parsed: ParsedSentence) -> set[str]:
    return {t.text() for t in parsed.triplets}


def test_spacy_collapses_prepositions(spacy_parser: SpacyParser) -> None:
    (parsed,) = spacy_parser.parse(["A dog runs in the grass ."])
    texts = _texts(parsed)
    assert "prep_in(runs, grass)" in texts
    assert "nsubj(runs, dog)" in texts
    assert all(t.rel not in {"punct", "ROOT", "prep", "pobj"} for t in parsed.triplets)
    assert parsed.tokens == ("a", "dog", "runs", "in", "the", "grass")
    assert all(t.w1.islower() and t.w2.islower() for t in parsed.triplets)


def test_a_triplet_reads_as_words(spacy_parser: SpacyParser) -> None:
    """The page's and the API's `phrase`: the two words in reading order, a collapsed preposition between."""
    (parsed,) = spacy_parser.parse(["A black dog jumps over the fence and catches a red ball ."])
    phrases = {t.text(): t.phrase() for t in parsed.triplets}
    assert phrases["nsubj(jumps, dog)"] == "dog jumps"
    assert phrases["amod(dog, black)"] == "black dog"
    assert phrases["prep_over(jumps, fence)"] == "jumps over fence"
    assert phrases["dobj(catches, ball)"] == "catches ball"
    assert phrases["det(dog, a)"] == "a dog"
    assert Triplet("agent", "chased", "dog").phrase() == "chased by dog"
    assert Triplet("prepc_in_front_of", "sits", "tree").phrase() == "sits in front of tree"
    assert Triplet("conj", "dog", "cat").phrase() == "dog, cat"
    assert Triplet("<word>", "dog", "dog").phrase() == "dog"
    assert Triplet("<sentence>", "", "").phrase() == "whole sentence"


def test_spacy_batch_order_agent_and_lowercase(spacy_parser: SpacyParser) -> None:
    out = spacy_parser.parse(["A Man is chased by a DOG .", "Dog", "Two girls play on the beach"])
    assert len(out) == 3
    assert "agent(chased, dog)" in _texts(out[0])
    assert out[1].tokens == ("dog",) and out[1].triplets == ()
    assert "prep_on(play, beach)" in _texts(out[2])


CAPTIONS = [
    "A black dog is running after a white dog in the snow .",
    "Two children play on a swing set in the park",
    "A man in a red jacket climbs a rock wall while another man watches .",
    "The girl with the blue hat is eating an ice cream cone",
    "Several people walk down a busy city street at night .",
    "A brown horse grazes in a field beside a wooden fence",
    "A boy jumps into the swimming pool , splashing water everywhere .",
    "Dogs",
    "An old woman sits on a bench reading a newspaper under a tree .",
    "A cyclist rides past a crowd of cheering fans on a mountain road",
    "A baby laughs as her father lifts her into the air .",
]


def test_shares_cut_at_whole_batches() -> None:
    assert shares(37, 2, 4) == [slice(0, 20), slice(20, 37)]
    assert shares(10, 2, 256) == [slice(0, 10)]  # one batch: nothing to share
    assert shares(1024, 3, 256) == [slice(0, 512), slice(512, 1024)]
    for n, parts, batch in ((1, 2, 1), (99, 4, 7), (5000, 2, 256)):
        cut = shares(n, parts, batch)
        assert cut[0].start == 0 and cut[-1].stop == n and len(cut) <= parts
        assert all(a.stop == b.start and (a.stop - a.start) % batch == 0 for a, b in itertools.pairwise(cut))


def test_a_parse_shared_among_processes_is_the_parse_of_one() -> None:
    """Captions in 2 processes (this one and a spawned worker) parse as in one: the same batches, the order kept."""
    captions = [CAPTIONS[k % len(CAPTIONS)] for k in range(0, 37 * 5, 5)]
    one = SpacyParser(max_words=64, batch_size=4, processes=1).parse(captions)
    two = SpacyParser(max_words=64, batch_size=4, processes=2, min_parallel=0).parse(captions)
    assert len(two) == len(captions)
    assert two == one
    assert [p.tokens[:2] for p in two[:3]] == [("a", "black"), ("a", "brown"), ("a", "baby")]


def test_spacy_truncates_long_captions() -> None:
    parser = SpacyParser(max_words=5)
    (parsed,) = parser.parse([" ".join(["dog"] * 50) + " ."])
    assert len(parsed.tokens) <= 5


def test_empty_caption_is_an_error(spacy_parser: SpacyParser) -> None:
    with pytest.raises(ValueError, match="empty caption"):
        spacy_parser.parse(["A dog .", "   "])
    with pytest.raises(ValueError, match="empty caption"):
        StanzaParser().parse([""])


def _word(i: int, text: str, head: int, deprel: str, upos: str = "NOUN") -> dict[str, Any]:
    return {"id": i, "text": text, "lemma": text.lower(), "upos": upos, "head": head, "deprel": deprel}


def test_stanza_document_conversion() -> None:
    from stanza import Document

    sent1 = [
        _word(1, "A", 2, "det", "DET"),
        _word(2, "dog", 3, "nsubj"),
        _word(3, "runs", 0, "root", "VERB"),
        _word(4, "in", 6, "case", "ADP"),
        _word(5, "the", 6, "det", "DET"),
        _word(6, "Park", 3, "obl"),
        _word(7, ".", 3, "punct", "PUNCT"),
    ]
    sent2 = [
        _word(1, "A", 2, "det", "DET"),
        _word(2, "man", 4, "nsubj:pass"),
        _word(3, "is", 4, "aux:pass", "AUX"),
        _word(4, "chased", 0, "root", "VERB"),
        _word(5, "by", 7, "case", "ADP"),
        _word(6, "a", 7, "det", "DET"),
        _word(7, "dog", 4, "obl:agent"),
        _word(8, "because", 10, "case", "ADP"),
        _word(9, "of", 8, "fixed", "ADP"),
        _word(10, "rain", 4, "obl"),
    ]
    parsed = stanza_document_to_parsed(Document([sent1, sent2]))
    assert len(parsed) == 2
    texts1 = _texts(parsed[0])
    assert "prep_in(runs, park)" in texts1
    assert "nsubj(runs, dog)" in texts1
    assert not any(t.rel in {"case", "punct", "root", "obl"} for t in parsed[0].triplets)
    assert parsed[0].tokens == ("a", "dog", "runs", "in", "the", "park")
    texts2 = _texts(parsed[1])
    assert "nsubj_pass(chased, man)" in texts2
    assert "agent(chased, dog)" in texts2
    assert "prep_because_of(chased, rain)" in texts2
    assert not any(t.rel in {"case", "fixed"} for t in parsed[1].triplets)


def test_stanza_without_models_is_a_clear_error() -> None:
    parser = make_parser("stanza")
    assert parser.name == "stanza"
    try:
        out = parser.parse(["A dog runs in the grass ."])
    except RuntimeError as err:
        assert "stanza" in str(err) and "not installed" in str(err)
        assert "spacy" in str(err)
    else:  # English models happen to be installed on this host
        assert "prep_in(runs, grass)" in _texts(out[0])


def test_make_parser_unknown() -> None:
    with pytest.raises(ValueError, match="spacy"):
        make_parser("corenlp")


def test_bow_and_bigram_modes() -> None:
    parsed = ParsedSentence(tokens=("a", "dog", "runs"), triplets=(Triplet("nsubj", "runs", "dog"),))
    assert sentence_triplets(parsed, "dependency") == [Triplet("nsubj", "runs", "dog")]
    assert sentence_triplets(parsed, "bow") == [
        Triplet("word", "a", "a"),
        Triplet("word", "dog", "dog"),
        Triplet("word", "runs", "runs"),
    ]
    bigrams = [Triplet("bigram", "a", "dog"), Triplet("bigram", "dog", "runs")]
    assert sentence_triplets(parsed, "bigram") == bigrams
    one = ParsedSentence(tokens=("dog",), triplets=())
    assert sentence_triplets(one, "bigram") == [Triplet("bigram", "dog", "dog")]
    with pytest.raises(ValueError, match="bigram"):
        sentence_triplets(parsed, "trigram")


def test_serialisation_round_trips() -> None:
    t = Triplet("prep_in", "runs", "grass")
    assert t.text() == "prep_in(runs, grass)"
    assert Triplet.from_list(json.loads(json.dumps(t.to_list()))) == t
    parsed = ParsedSentence(tokens=("dog", "runs"), triplets=(t,))
    assert ParsedSentence.from_dict(json.loads(json.dumps(parsed.to_dict()))) == parsed


def test_relation_vocab_cutoff_and_round_trip() -> None:
    # 1000 relations: nsubj 60 %, det 37.5 %, prep_in 2 % (kept), dobj 0.5 % (dropped)
    counts = {"nsubj": 600, "det": 375, "prep_in": 20, "dobj": 5}
    lists = [[Triplet(rel, "a", "b")] * n for rel, n in counts.items()]
    vocab = RelationVocab.fit(lists, cutoff=0.01)
    assert vocab.kept == ("nsubj", "det", "prep_in")
    assert len(vocab) == 3
    assert vocab.index("nsubj") == 0 and vocab.index("prep_in") == 2
    assert vocab.index("dobj") is None
    assert vocab.counts == counts
    assert vocab.dropped == ("dobj",)
    assert vocab.coverage == pytest.approx(0.995)
    again = RelationVocab.from_dict(json.loads(json.dumps(vocab.to_dict())))
    assert again == vocab and again.kept == vocab.kept and again.index("det") == 1
    assert len(RelationVocab.fit([], cutoff=0.01)) == 0


def test_relation_cutoff_at_its_boundary() -> None:
    """A relation type with exactly 1 % of the training relations is kept; one relation fewer is not."""
    for total in (100, 300, 700, 1000):
        at = total // 100  # exactly 1 %
        lists = [[Triplet("amod", "a", "b")] * at, [Triplet("det", "a", "b")] * (total - at)]
        assert RelationVocab.fit(lists, cutoff=0.01).kept == ("det", "amod"), total
        below = [[Triplet("amod", "a", "b")] * at, [Triplet("det", "a", "b")] * (total - at + 1)]
        assert RelationVocab.fit(below, cutoff=0.01).kept == ("det",), total
        assert RelationVocab.fit(lists, cutoff=0.0100001).kept == ("det",), total


class CountingParser:
    """The spaCy parser under another version string, counting the sentences it parses."""

    name = "spacy"

    def __init__(self, inner: SpacyParser, version: str) -> None:
        self.inner, self.version, self.parsed = inner, version, 0

    def parse(self, sentences: Sequence[str]) -> list[ParsedSentence]:
        self.parsed += len(sentences)
        return self.inner.parse(sentences)


def test_the_parse_cache_is_keyed_by_the_parser_versions(spacy_parser: SpacyParser, tmp_path: Path) -> None:
    """A new spaCy or parser-model release (spacy>=3.8,<3.9 floats) must parse anew, not reuse old parses."""
    import spacy

    assert f"spacy-{spacy.__version__} " in spacy_parser.version
    assert f"_{spacy_parser.nlp.meta['name']}-{spacy_parser.nlp.meta['version']}" in spacy_parser.version
    captions = ["a dog runs on the grass", "two children play in the water"]
    old = CountingParser(spacy_parser, "spacy-3.8.0 en_core_web_sm-3.8.0")
    first = parse_cached(old, captions, tmp_path)
    assert parse_cached(old, captions, tmp_path) == first and old.parsed == 2  # the cache answers
    new = CountingParser(spacy_parser, "spacy-3.8.9 en_core_web_sm-3.8.1")
    assert parse_cached(new, captions, tmp_path) == first and new.parsed == 2  # parsed again
    assert SpacyParser(max_words=5).version != spacy_parser.version  # the cut-off decides the parse too
    assert "max_words=5" in StanzaParser(max_words=5).version
