"""bench.million's own parts: the search settings it parses (--sweep, --save-setting) and the
exhaustive truth it keeps in its work folder, which belongs to one collection only."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.million import ground_truth, search_setting
from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.images import exact_top_k
from fragsearch.model.bundle import Bundle
from fragsearch.model.embed import embed_sentence
from fragsearch.model.words import WordTable
from tests.test_codes import images, vector_images
from tests.test_index import QUERIES, WORDS, make_bundle


def test_a_search_setting_reads_three_to_five_whole_numbers():
    base = IndexSettings.of(kind="ivfpq", nlist=8, prescore=7, refine=3)
    three = search_setting(base, "16:65536:200").search
    assert (three.nprobe, three.k_prime, three.rerank, three.prescore, three.refine) == (16, 65536, 200, 0, 0)
    assert search_setting(base, "16:65536:200").shape.nlist == 8  # the rest comes from the base
    five = search_setting(base, " 32:1024:100:4096:512").search
    assert (five.nprobe, five.k_prime, five.rerank, five.prescore, five.refine) == (32, 1024, 100, 4096, 512)
    for bad in ("16:65536", "16:65536:200:1:2:3:4", "16:x:200", "16:-1:200", ""):
        with pytest.raises(SystemExit, match="nprobe:k_prime:rerank"):
            search_setting(base, bad)


def test_the_kept_truth_is_used_only_for_the_collection_it_was_computed_on(tmp_path: Path):
    first = make_bundle(WordTable.build(WORDS), seed=0)
    other = make_bundle(WordTable.build(WORDS), seed=1)  # another model: other vectors, other fingerprint
    queries = [embed_sentence(first, q)[0] for q in QUERIES[:3]]
    args = argparse.Namespace(work=tmp_path, build_threads=1, threads=1, exhaustive_timed=1)

    def built(bundle: Bundle, name: str) -> ImageIndex:
        ix = ImageIndex.create(tmp_path / name, bundle, IndexSettings.of(store_dtype="float16"))
        ix.add(*vector_images(*images(40)), read_places=False)
        ix.save()
        return ix

    a = built(first, "a")
    truth, _ = ground_truth(args, a, queries)
    kept = tmp_path / "truth-3.json"
    assert json.loads(kept.read_text())["fingerprint"] == a.fingerprint
    assert truth == [[i for i, _ in r] for r in exact_top_k(a, queries, 10)]
    kept.write_text(kept.read_text().replace(json.dumps(truth), json.dumps([[0]] * 3)))
    assert ground_truth(args, a, queries)[0] == [[0]] * 3  # the same collection reads the kept file
    b = built(other, "b")  # as many images, another model
    assert len(b) == len(a) and b.fingerprint != a.fingerprint
    again, _ = ground_truth(args, b, queries)
    assert again == [[i for i, _ in r] for r in exact_top_k(b, queries, 10)]
    assert json.loads(kept.read_text())["fingerprint"] == b.fingerprint
    a.close()
    b.close()
