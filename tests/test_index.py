"""The fragment indexes on a small real model (MiniLM word table, spaCy parser, random fragment weights)."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

import fragsearch.index.store
import fragsearch.model.atomic
from fragsearch.commands.index_build import main as build_main
from fragsearch.index import ImageIndex, IndexLoadError, IndexSettings, SentenceIndex, list_images, saving
from fragsearch.index import ids as fid
from fragsearch.index.base import FragmentIndex
from fragsearch.index.catalogue import is_index
from fragsearch.index.images import embedded_images
from fragsearch.index.ranker import Ranker
from fragsearch.index.sentences import DEFAULT_SETTINGS as DEFAULT_SENTENCE_SETTINGS
from fragsearch.index.types import BackendOptions
from fragsearch.model import onnx
from fragsearch.model.bundle import Bundle
from fragsearch.model.config import ImageConfig, TextConfig
from fragsearch.model.embed import EmbeddedImage, EmbeddedSentence, embed_sentence
from fragsearch.model.encoders import ModelConfig
from fragsearch.model.fragments import WORD_REL, TextPipeline
from fragsearch.model.image import RegionExtractor
from fragsearch.model.text import RelationVocab
from fragsearch.model.words import WordTable
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import FragmentModel
from tests.conftest import exported

H = 32
F = 5  # fragments per test image: the whole image + 4 regions
WORDS = [
    "a", "an", "the", "dog", "cat", "man", "woman", "ball", "red", "blue", "green", "yellow", "white",
    "black", "small", "big", "circle", "square", "triangle", "runs", "jumps", "sits", "plays", "on", "in",
    "at", "beside", "near", "next", "to", "with", "of", "and", "is", "are", "picture", "grass", "water",
    "street",
]
RELATIONS = ["det", "amod", "nsubj", "dobj", "prep_on", "prep_in", "prep_at", "prep_beside", "prep_near",
             "prep_with", "prep_of", "cc", "conj", "aux", "advmod", "compound", WORD_REL]
IMAGE_CFG = ImageConfig(n_regions=F - 1, backbone_size=224, proposal_resize=128, max_proposals=40)
QUERIES = ["a red dog runs on the grass", "a man plays with a ball", "the small cat sits near the water",
           "a woman is in the street", "a big black dog jumps", "a blue circle beside a yellow square"]


@pytest.fixture(autouse=True)
def candidate_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests of this module exercise the candidate stage on collections small enough for the exact
    scan (`IndexSettings.exact_below`): keep the candidates on. The scan has its own test."""
    monkeypatch.setattr(Ranker, "small", lambda self: False)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The machine is shared: one thread each keeps the runtime (ONNX Runtime, torch where imported) and FAISS
    from oversubscribing it."""
    threads, faiss_threads = onnx.default_threads(), faiss.omp_get_max_threads()
    onnx.set_threads(1)
    faiss.omp_set_num_threads(1)
    yield
    onnx.set_threads(threads)
    faiss.omp_set_num_threads(faiss_threads)


@pytest.fixture(scope="module")
def words() -> WordTable:
    return WordTable.build(WORDS)


def make_bundle(words: WordTable, h: int = H, seed: int = 0) -> Bundle:
    relations = RelationVocab(RELATIONS, {}, 0.01)
    text = TextPipeline(TextConfig(), relations, words)
    torch.manual_seed(seed)
    model = FragmentModel(ModelConfig(h=h, n_relations=len(relations)))
    return Checkpoint(model.eval(), text, IMAGE_CFG).bundle()


@pytest.fixture(scope="module")
def bundle(words: WordTable) -> Bundle:
    return make_bundle(words)


@pytest.fixture(scope="module")
def extractor() -> RegionExtractor:
    return RegionExtractor(IMAGE_CFG)


def random_images(index: ImageIndex, n: int, seed: int, f: int = F) -> list[int]:
    """n images of f random fragment vectors each (synthetic: only the index is under test)."""
    rng = np.random.default_rng(seed)
    vecs = rng.standard_normal((n, f, index.dim)).astype(np.float32)
    boxes = np.tile(np.array([0, 0, 100, 80], np.float32), (n, f, 1))
    boxes[:, 1:, 2:] = rng.uniform(10, 80, (n, f - 1, 2))
    names = [f"img{seed}_{k}.jpg" for k in range(n)]
    return index.add(embedded_images(vecs, boxes, np.tile([100, 80], (n, 1))), names, [f"/photos/{x}" for x in names],
                     read_places=False)


def name_of(index: ImageIndex, image_id: int) -> str:
    rec = index.get(image_id)
    assert rec is not None
    return rec.name


def name_text(index: SentenceIndex, sentence_id: int) -> str:
    rec = index.get(sentence_id)
    assert rec is not None
    return rec.text


def ranking(hits: list) -> list[tuple[int, float]]:
    return [(h.image_id if hasattr(h, "image_id") else h.sentence_id, round(h.score, 5)) for h in hits]


def recall_all(index: FragmentIndex) -> None:
    """Searches go through the candidate stage (never the exact scan) with k' beyond every fragment held:
    each item with a fragment in the candidate backend is recalled, so a search ranks as the exhaustive
    ranking does exactly when the backend holds every live item."""
    index.set_search(exact_below=0, k_prime=max(1, index.n_fragments, index.candidates.ntotal) + 1)


def picture(colour: tuple[int, int, int], shape: str, size: tuple[int, int] = (160, 120)) -> Image.Image:
    img = Image.new("RGB", size, (245, 245, 245))
    draw = ImageDraw.Draw(img)
    box = (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=colour)
    return img


@pytest.fixture(params=["faiss", "milvus"])
def backend(request: pytest.FixtureRequest) -> BackendOptions:
    """Where the candidate vectors live: in-process FAISS, or Milvus (milvus-lite in the index folder)."""
    return BackendOptions(request.param)


@pytest.fixture()
def image_index(tmp_path: Path, bundle: Bundle, backend: BackendOptions) -> Iterator[ImageIndex]:
    index = ImageIndex.create(tmp_path / "images", bundle, backend=backend)
    random_images(index, 40, seed=1)
    index.save()
    yield index
    index.close()


@pytest.fixture()
def faiss_index(tmp_path: Path, bundle: Bundle) -> Iterator[ImageIndex]:
    """`image_index` on FAISS only: for tests of FAISS files and of the FAISS candidate stage."""
    index = ImageIndex.create(tmp_path / "images", bundle)
    random_images(index, 40, seed=1)
    index.save()
    yield index
    index.close()


# -- ids ------------------------------------------------------------------------------------------------
def test_ids_encode_item_and_fragment_and_decode_back():
    items = np.array([0, 1, 7, 123_456_789, fid.MAX_ITEM])
    frags = np.array([0, 19, 3, fid.MAX_FRAGMENTS - 1, 5])
    ids = fid.encode(items, frags)
    assert len(set(ids.tolist())) == len(ids)
    back_items, back_frags = fid.decode(ids)
    assert back_items.tolist() == items.tolist() and back_frags.tolist() == frags.tolist()
    assert fid.decode(np.array([-1]))[0].tolist() == [-1]  # FAISS "no result" stays -1
    lo, hi = fid.item_range(7)
    assert all(lo <= i < hi for i in fid.item_fragments(7, 20)) and fid.encode(8, 0) == hi
    with pytest.raises(ValueError):
        fid.encode(1, fid.MAX_FRAGMENTS)
    with pytest.raises(ValueError):
        fid.encode(-1, 0)


def test_faiss_holds_every_fragment_under_its_item_id(faiss_index: ImageIndex):
    flat: Any = faiss.downcast_index(faiss_index.candidates.index)
    items, frags = fid.decode(faiss.vector_to_array(flat.id_map))
    assert sorted(zip(items.tolist(), frags.tolist(), strict=True)) == [(i, f) for i in range(40) for f in range(F)]
    inner: Any = faiss.downcast_index(flat.index)
    for pos in (0, 17, 199):  # the vector under id (item, fragment) is that fragment's stored vector
        item = int(items[pos])
        stored = faiss_index.store.rows(int(faiss_index.items.seg[item]), int(faiss_index.items.off[item]), F)
        assert np.array_equal(inner.reconstruct(pos), stored[frags[pos]])


# -- search -----------------------------------------------------------------------------------------------
def test_flat_search_equals_exhaustive_exact_ranking(tmp_path: Path, bundle: Bundle, backend: BackendOptions):
    index = ImageIndex.create(tmp_path / "flat", bundle, backend=backend)  # default settings: flat, k_prime=128
    random_images(index, 120, seed=2)
    for q in QUERIES:
        fast, slow = index.search(q, 10).hits, index.search(q, 10, exhaustive=True).hits
        assert ranking(fast) == ranking(slow), q
        assert [m.triplet for m in fast[0].alignment] == [m.triplet for m in slow[0].alignment]
    # the exhaustive ranking is the model's own score over every image
    sent, _ = embed_sentence(bundle, QUERIES[0])
    vecs, mask = index.stored.vectors(index.ids())
    scores = bundle.scores(vecs, mask, sent[None], np.ones((1, len(sent)), np.float32))[:, 0]
    order = np.argsort(-scores, kind="stable")[:10]
    whole = index.search(QUERIES[0], 10, exhaustive=True).hits
    assert [h.image_id for h in whole] == index.ids()[order].tolist()
    index.close()


def test_small_collections_are_scanned_exactly(tmp_path: Path, bundle: Bundle, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.undo()  # the real policy
    settings = IndexSettings.of(k_prime=1)  # one neighbour per query fragment: candidates miss images
    small = ImageIndex.create(tmp_path / "small", bundle, settings)
    random_images(small, 60, seed=5)
    assert small.n_fragments <= settings.search.exact_below
    for q in QUERIES:
        assert ranking(small.search(q, 10).hits) == ranking(small.search(q, 10, exhaustive=True).hits), q
    small.set_search(exact_below=0)  # the candidate stage alone finds fewer than 10 for some query
    assert any(ranking(small.search(q, 10).hits) != ranking(small.search(q, 10, exhaustive=True).hits) for q in QUERIES)
    small.set_search(exact_below=small.n_fragments - 1)  # one fragment more than the limit: candidates
    assert any(ranking(small.search(q, 10).hits) != ranking(small.search(q, 10, exhaustive=True).hits) for q in QUERIES)
    small.close()


def test_a_page_carries_the_best_scores_of_the_items_it_ranked(tmp_path: Path, bundle: Bundle,
                                                                monkeypatch: pytest.MonkeyPatch):
    """Every page, and an explanation, carries the best `CONTEXT` scores of what the exact score ranked (the
    collection scanned whole, or the recalled candidates), best first, whatever the page's offset and size,
    and the size of the collection searched: what a result's relevance reads."""
    from fragsearch.index.ranker import CONTEXT

    monkeypatch.undo()  # the real policy: scanned whole under exact_below fragments
    index = ImageIndex.create(tmp_path / "best", bundle, IndexSettings.of(k_prime=1))
    random_images(index, 60, seed=5)
    query = QUERIES[0]
    sent, _ = embed_sentence(bundle, query)
    vecs, mask = index.stored.vectors(index.ids())
    every = np.sort(bundle.scores(vecs, mask, sent[None], np.ones((1, len(sent)), np.float32))[:, 0])[::-1]
    for k, offset in ((3, 0), (2, 5)):
        page = index.search(query, k, offset)
        np.testing.assert_allclose(page.best, every[:CONTEXT], rtol=1e-5)  # scanned: all 60
        assert page.collection == 60
    e = index.explain(index.search(query, 1).hits[0].image_id, query)
    assert e is not None and e.collection == 60
    np.testing.assert_allclose(e.best, every[:CONTEXT], rtol=1e-5)
    index.remove(int(index.ids()[0]))
    assert index.search(query, 3).collection == 59  # the live items
    index.set_search(exact_below=0)  # the candidates: their scores only
    recalled = index.ranker.candidates(sent)
    assert 0 < len(recalled) < 60
    page = index.search(query, 3)
    assert page.considered == len(recalled) == len(page.best) and page.collection == 59
    rv, rm = index.stored.vectors(recalled)
    mine = np.sort(bundle.scores(rv, rm, sent[None], np.ones((1, len(sent)), np.float32))[:, 0])[::-1]
    np.testing.assert_allclose(page.best, mine[:CONTEXT], rtol=1e-5)
    assert [h.score for h in page.hits] == pytest.approx(page.best[:3].tolist(), rel=1e-5)
    index.close()


def test_explain_ranks_the_collection_or_the_candidates_as_a_search_does(tmp_path: Path, bundle: Bundle,
                                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.undo()  # the real policy: scanned whole under exact_below fragments
    index = ImageIndex.create(tmp_path / "explain", bundle, IndexSettings.of(k_prime=1))
    random_images(index, 60, seed=5)
    query = QUERIES[0]
    whole = index.search(query, 60, exhaustive=True).hits
    for place, hit in enumerate(whole[:5], start=1):
        e = index.explain(hit.image_id, query)
        assert e is not None and (e.scope, e.recalled, e.rank, e.images) == ("collection", True, place, 60)
    index.set_search(exact_below=0)  # a large collection: the rank is taken over the recalled candidates
    sent, _ = embed_sentence(bundle, query)
    recalled = set(index.ranker.candidates(sent).tolist())
    assert 0 < len(recalled) < 60
    found = index.search(query, 60).hits
    for place, hit in enumerate(found, start=1):  # a recalled image: the rank the search gave it
        e = index.explain(hit.image_id, query)
        assert e is not None and (e.scope, e.recalled, e.rank, e.images) == ("candidates", True, place, len(recalled))
        assert e.score == pytest.approx(hit.score, abs=1e-6)
    missed = next(h for h in whole if h.image_id not in recalled)
    e = index.explain(missed.image_id, query)  # not recalled: ranked among the candidates as if it were
    assert e is not None and (e.scope, e.recalled, e.images) == ("candidates", False, len(recalled) + 1)
    assert e.rank == 1 + sum(h.score > missed.score or (h.score == missed.score and h.image_id < missed.image_id)
                             for h in found)
    assert e.score == pytest.approx(missed.score, abs=1e-6)
    index.close()


def test_rerank_limits_the_exactly_scored_candidates_to_the_best_partial_scores(faiss_index: ImageIndex,
                                                                                 bundle: Bundle):
    sent, _ = embed_sentence(bundle, QUERIES[0])
    faiss_index.set_search(k_prime=200)  # every fragment is a hit: the partial scores are complete
    every = faiss_index.ranker.candidates(sent)
    faiss_index.set_search(rerank=8)
    few = faiss_index.ranker.candidates(sent)
    assert len(few) == 8 < len(every) == 40
    # the 8 kept are those whose retrieved fragments add up to the most positive score
    vecs, mask = faiss_index.stored.vectors(every)
    partial = (np.maximum(vecs @ sent.T, 0) * mask[..., None]).sum((1, 2))
    assert set(few.tolist()) == set(every[np.argsort(-partial)[:8]].tolist())
    faiss_index.set_search(rerank=40)  # as many as there are images: the exhaustive ranking
    exact = faiss_index.search(QUERIES[0], 10, exhaustive=True).hits
    assert ranking(faiss_index.search(QUERIES[0], 10).hits) == ranking(exact)


def test_search_returns_alignment_with_triplets_and_boxes(image_index: ImageIndex):
    hits = image_index.search("a red dog runs on the grass", 3).hits
    assert len(hits) == 3 and hits[0].score >= hits[1].score >= hits[2].score > 0
    triplets = {m.triplet for h in hits for m in h.alignment}
    assert "amod(dog, red)" in triplets and "prep_on(runs, grass)" in triplets
    for h in hits:
        rec = image_index.get(h.image_id)
        assert rec is not None and (h.name, h.path, h.width, h.height) == (rec.name, rec.path, 100, 80)
        for m in h.alignment:
            assert m.score > 0 and m.box == rec.boxes[m.fragment] and m.relation == m.triplet.split("(")[0]


def test_added_image_is_found(image_index: ImageIndex, bundle: Bundle):
    sent, _ = embed_sentence(bundle, QUERIES[1])
    target = sent.sum(0) / np.linalg.norm(sent.sum(0)) * 100  # aligned with every fragment of the query
    vecs = np.repeat(target[None, None], F, axis=1)
    boxes = np.tile(np.array([0, 0, 50, 50], np.float32), (1, F, 1))
    [new] = image_index.add(embedded_images(vecs, boxes, np.array([[50, 50]])), ["new.jpg"], ["/photos/new.jpg"],
                            read_places=False)
    hits = image_index.search(QUERIES[1], 5).hits
    assert hits[0].image_id == new and hits[0].name == "new.jpg"
    assert image_index.search(QUERIES[1], 1, exhaustive=True).hits[0].image_id == new


def test_add_paths_extracts_real_pictures_and_skips_unreadable_files(tmp_path: Path, bundle: Bundle,
                                                                     extractor: RegionExtractor):
    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True)
    picture((220, 30, 30), "circle").save(photos / "red.jpg")
    picture((30, 60, 220), "square", (200, 100)).save(photos / "sub" / "blue.png")
    picture((30, 170, 60), "circle").save(photos / "sub" / "red.jpg")  # same file name, another picture
    (photos / "broken.jpg").write_bytes(b"not an image")
    index = ImageIndex.create(tmp_path / "idx", bundle)
    paths = list_images(photos)
    report = index.photos.add(paths)
    assert len(report.added) == 3 and [Path(p).name for p, _ in report.skipped] == ["broken.jpg"]
    blue = index.get(next(i for i in report.added if name_of(index, i) == "blue.png"))
    assert blue is not None and (blue.width, blue.height) == (200, 100) and len(blue.boxes) == F
    assert blue.boxes[0] == [0.0, 0.0, 200.0, 100.0]
    # the two red.jpg files are two different pictures with their own features
    reds = [i for i in report.added if name_of(index, i) == "red.jpg"]
    a, b = (index.store.rows(int(index.items.seg[i]), int(index.items.off[i]), F) for i in reds)
    assert not np.allclose(a, b)
    # the same image added directly embeds to the same vectors as through add_paths
    direct = index.add([Image.open(photos / "sub" / "blue.png").convert("RGB")], ["blue2"], [photos / "x.png"])[0]
    ia = next(i for i in report.added if name_of(index, i) == "blue.png")
    va = index.store.rows(int(index.items.seg[ia]), int(index.items.off[ia]), F)
    vb = index.store.rows(int(index.items.seg[direct]), int(index.items.off[direct]), F)
    assert np.allclose(va, vb, atol=2e-2)  # the cache keeps features in float16
    again = index.photos.add(paths)
    assert again.added == [] and again.present == 3
    index.close()


def test_region_search_finds_the_best_fragments(image_index: ImageIndex, bundle: Bundle):
    hits = image_index.search_fragments("amod(dog, red)", 5).hits
    assert len(hits) == 5 and all(a.score >= b.score for a, b in zip(hits, hits[1:], strict=False))
    sent, _ = embed_sentence(bundle, "red dog")  # the phrase parses to the same triplet
    vecs, mask = image_index.stored.vectors(image_index.ids())
    dots = np.maximum(vecs @ sent[0], 0) * mask
    flat = np.argsort(-dots.flatten(), kind="stable")[:5]
    expected = [(int(image_index.ids()[i // vecs.shape[1]]), int(i % vecs.shape[1])) for i in flat]
    assert [(h.image_id, h.fragment) for h in hits] == expected
    assert [h.image_id for h in image_index.search_fragments("red dog", 5).hits] == [e[0] for e in expected]


def test_empty_indexes_answer_with_no_hits(tmp_path: Path, bundle: Bundle, backend: BackendOptions):
    images = ImageIndex.create(tmp_path / "empty-images", bundle, backend=backend)
    sentences = SentenceIndex.create(tmp_path / "empty-sentences", bundle, backend=backend)
    assert len(images) == 0 and images.search(QUERIES[0], 5).hits == []
    assert images.search(QUERIES[0], exhaustive=True).hits == []
    assert images.search_fragments("red dog").hits == [] and images.get(0) is None and not images.remove(0)
    img = np.ones((F, H), np.float32)
    assert sentences.annotate(EmbeddedImage(img, np.zeros((F, 4)), 0, 0), 5).hits == []
    images.close()
    sentences.close()


def test_bad_queries_raise_value_errors(faiss_index: ImageIndex):
    with pytest.raises(ValueError):
        faiss_index.search("   ", 5)
    with pytest.raises(ValueError):  # NoFragmentsError: no word of it is known
        faiss_index.search("zxqv wqqz", 5)


# -- removal --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_removed_image_is_never_returned_again(tmp_path: Path, bundle: Bundle, kind: str, backend: BackendOptions):
    index = ImageIndex.create(tmp_path / kind, bundle, IndexSettings.of(kind=kind, k_prime=200), backend=backend)
    random_images(index, 30, seed=3)
    index.save()
    top = index.search(QUERIES[0], 1).hits[0].image_id
    region = index.search_fragments("red dog", 1).hits[0].image_id
    assert index.remove(top) and index.remove(region) is (region != top)
    assert not index.remove(top) and index.get(top) is None and len(index) == 28

    def returned(ix: ImageIndex) -> set[int]:
        out = {h.image_id for q in QUERIES for h in ix.search(q, 30).hits + ix.search(q, 30, exhaustive=True).hits}
        return out | {h.image_id for h in ix.search_fragments("red dog", 200).hits}

    assert top not in returned(index) and region not in returned(index)
    index.save()
    index.close()
    loaded = ImageIndex.load(tmp_path / kind, bundle)
    assert len(loaded) == 28 and top not in returned(loaded) and region not in returned(loaded)
    assert loaded.get(top) is None and not loaded.remove(top)
    loaded.close()


# -- persistence ------------------------------------------------------------------------------------------
def test_save_load_round_trip_gives_equal_results(image_index: ImageIndex, bundle: Bundle):
    random_images(image_index, 5, seed=4)  # unsaved adds
    image_index.remove(3)
    before = {q: image_index.search(q, 8).hits for q in QUERIES}
    regions = image_index.search_fragments("a man", 6).hits
    image_index.save()
    loaded = ImageIndex.load(image_index.root, bundle)
    assert len(loaded) == len(image_index) == 44
    for q in QUERIES:
        assert loaded.search(q, 8).hits == before[q]
    assert loaded.search_fragments("a man", 6).hits == regions
    assert loaded.get(41) == image_index.get(41)
    loaded.close()


def test_a_folder_is_an_index_once_it_is_saved(tmp_path: Path, bundle: Bundle):
    root = tmp_path / "images"
    assert not is_index(root) and not is_index(tmp_path)
    index = ImageIndex.create(root, bundle)
    random_images(index, 3, seed=2)
    index.save()
    assert is_index(root) and not is_index(tmp_path)
    index.close()


def test_float16_store_and_many_saves_merge_segments(tmp_path: Path, bundle: Bundle):
    index = ImageIndex.create(tmp_path / "fp16", bundle, IndexSettings.of(store_dtype="float16"))
    for seed in range(20):
        random_images(index, 3, seed=seed)
        index.save()
    assert len(index.store.files) <= 16 + 1
    before = {q: dict(ranking(index.search(q, 60, exhaustive=True).hits)) for q in QUERIES}
    for i in range(0, 45):
        index.remove(i)  # most rows now belong to removed images: the next save rewrites the store
    index.save()
    assert len(index.store.files) == 1 and index.store.segment_rows() == [15 * F]
    loaded = ImageIndex.load(index.root, bundle)
    for q in QUERIES:
        hits = ranking(loaded.search(q, 10).hits)
        assert hits == ranking(loaded.search(q, 10, exhaustive=True).hits) and len(hits) == 10
        assert all(i >= 45 and before[q][i] == s for i, s in hits)  # same vectors, same scores
    assert {p.name for p in index.root.glob("store-*")} == set(loaded.store.files)
    loaded.close()
    index.close()


def test_store_blocks_and_segments_keep_every_item_intact(tmp_path: Path, bundle: Bundle,
                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fragsearch.index.store, "BLOCK_ROWS", 7)  # items of 5 rows leave blocks partly filled
    ix = ImageIndex.create(tmp_path / "blocks", bundle)
    rng = np.random.default_rng(10)
    vecs = [rng.standard_normal((n, H)).astype(np.float32) for n in (5, 3, 9, 1, 5, 5, 2)]
    ids = [ix.add(embedded_images(v[None], np.zeros((1, len(v), 4)), np.array([[1, 1]])), [str(i)], [str(i)],
                  read_places=False)[0]
           for i, v in enumerate(vecs)]
    for i, v in zip(ids, vecs, strict=True):
        assert np.array_equal(ix.store.rows(int(ix.items.seg[i]), int(ix.items.off[i]), len(v)), v)
    gathered, mask = ix.stored.vectors(np.array(ids))
    assert mask.sum(1).tolist() == [len(v) for v in vecs]
    ix.save()
    loaded = ImageIndex.load(ix.root, bundle)
    got, _ = loaded.stored.vectors(np.array(ids))
    assert np.array_equal(got, gathered)
    for i, v in zip(ids, vecs, strict=True):
        assert np.array_equal(loaded.store.rows(int(loaded.items.seg[i]), int(loaded.items.off[i]), len(v)), v)
    loaded.close()
    ix.close()


def test_crash_between_write_and_rename_leaves_the_old_state(faiss_index: ImageIndex, bundle: Bundle,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    before = {q: ranking(faiss_index.search(q, 5).hits) for q in QUERIES}
    random_images(faiss_index, 10, seed=5)
    faiss_index.remove(0)
    crashed = tmp_path / "at-crash"
    real_replace = fragsearch.model.atomic.os.replace

    def crash(src: str, dst: str) -> None:
        if "faiss-" in str(dst):  # the new store file is renamed already, the FAISS file is not
            shutil.copytree(faiss_index.root, crashed)  # the folder as a crash would leave it
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(fragsearch.model.atomic.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        faiss_index.save()
    monkeypatch.setattr(fragsearch.model.atomic.os, "replace", real_replace)
    assert any(p.name.endswith(".tmp") for p in crashed.iterdir())  # the unrenamed file is there
    old = ImageIndex.load(crashed, bundle)
    assert len(old) == 40 and old.get(0) is not None
    assert {q: ranking(old.search(q, 5).hits) for q in QUERIES} == before
    old.save()  # a later save of the old state cleans the stray files
    assert not any(p.name.endswith(".tmp") for p in crashed.iterdir())
    old.close()
    # the running index still holds the new state and saves it on the next try
    faiss_index.save()
    again = ImageIndex.load(faiss_index.root, bundle)
    assert len(again) == 49 and again.get(0) is None
    again.close()


def test_crash_after_rename_before_commit_leaves_the_old_state(faiss_index: ImageIndex, bundle: Bundle,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    before = ranking(faiss_index.search(QUERIES[0], 10).hits)
    random_images(faiss_index, 10, seed=6)
    crashed = tmp_path / "at-crash"

    class Crash(BaseException):
        pass

    def crash(*args: object, **kwargs: object) -> None:
        shutil.copytree(faiss_index.root, crashed)  # every new file is in place, the database not updated
        raise Crash

    monkeypatch.setattr(saving, "commit", crash)
    with pytest.raises(Crash):
        faiss_index.save()
    old = ImageIndex.load(crashed, bundle)
    assert len(old) == 40 and ranking(old.search(QUERIES[0], 10).hits) == before
    old.close()


def test_corrupt_files_fail_at_load_with_a_clear_error(faiss_index: ImageIndex, bundle: Bundle, tmp_path: Path):
    faiss_index.close()
    root = faiss_index.root

    def damaged(pattern: str, damage: str) -> Path:
        copy = tmp_path / f"{pattern.strip('*.-')}-{damage}"
        shutil.copytree(root, copy)
        target = next(copy.glob(pattern))
        data = bytearray(target.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data[: len(data) // 2]) if damage == "truncate" else bytes(data))
        return copy

    with pytest.raises(IndexLoadError, match="FAISS file .* corrupt"):
        ImageIndex.load(damaged("faiss-*", "flip"), bundle)
    with pytest.raises(IndexLoadError, match="store file .* corrupt"):
        ImageIndex.load(damaged("store-*", "truncate"), bundle)
    with pytest.raises(IndexLoadError, match="not a readable index database|corrupt"):
        ImageIndex.load(damaged("index.sqlite", "truncate"), bundle)
    missing = tmp_path / "missing-faiss"
    shutil.copytree(root, missing)
    next(missing.glob("faiss-*")).unlink()
    with pytest.raises(IndexLoadError, match="FAISS file .* missing"):
        ImageIndex.load(missing, bundle)
    with pytest.raises(IndexLoadError, match="no image index"):
        ImageIndex.load(tmp_path / "nowhere", bundle)
    with pytest.raises(IndexLoadError, match="is an index of images, not of sentences"):
        SentenceIndex.load(root, bundle)


def test_index_of_another_model_or_dimension_is_rejected(faiss_index: ImageIndex, words: WordTable):
    faiss_index.close()
    with pytest.raises(IndexLoadError, match="16-d"):
        ImageIndex.load(faiss_index.root, make_bundle(words, h=16))
    with pytest.raises(IndexLoadError, match="another model"):
        ImageIndex.load(faiss_index.root, make_bundle(words, seed=1))
    small = ImageIndex.create(faiss_index.root.parent / "x", make_bundle(words, h=16))
    with pytest.raises(ValueError, match="expected"):
        small.add(embedded_images(np.zeros((1, F, H), np.float32), np.zeros((1, F, 4)), np.array([[1, 1]])), ["a"],
                  ["a"], read_places=False)
    small.close()
    with pytest.raises(FileExistsError):
        ImageIndex.create(faiss_index.root, make_bundle(words))


# -- other index kinds ------------------------------------------------------------------------------------
def test_ivf_trains_once_enough_fragments_exist_and_keeps_working(tmp_path: Path, bundle: Bundle):
    settings = IndexSettings.of(kind="ivf", nlist=4, nprobe=4, train_size=300, k_prime=32)
    index = ImageIndex.create(tmp_path / "ivf", bundle, settings)
    random_images(index, 20, seed=7)  # 100 fragments: the flat stand-in answers
    assert not index.candidates.trained and index.candidates.active_kind == "flat"
    random_images(index, 60, seed=8)  # 400 fragments: trained
    assert index.candidates.trained and index.candidates.ntotal == 400
    for q in QUERIES:  # nprobe = nlist visits every list: exact candidates
        assert ranking(index.search(q, 5).hits) == ranking(index.search(q, 5, exhaustive=True).hits)
    index.remove(5)
    index.save()
    loaded = ImageIndex.load(index.root, bundle, nprobe=1)
    assert loaded.candidates.trained and loaded.candidates.ntotal == 395 and loaded.settings.search.nprobe == 1
    assert all(h.image_id != 5 for q in QUERIES for h in loaded.search(q, 10).hits)
    loaded.close()
    index.close()


def test_bulk_adds_train_on_a_sample_of_everything(tmp_path: Path, bundle: Bundle):
    settings = IndexSettings.of(kind="ivfpq", nlist=2, m=4, nbits=4, nprobe=2, train_size=200, k_prime=64)
    index = ImageIndex.create(tmp_path / "pq", bundle, settings)
    with index.bulk():
        random_images(index, 50, seed=9)
        assert index.candidates.ntotal == 0
    assert index.candidates.trained and index.candidates.ntotal == 250
    hits = index.search(QUERIES[0], 5).hits
    exact = {h.image_id: h.score for h in index.search(QUERIES[0], 50, exhaustive=True).hits}
    assert all(abs(exact[h.image_id] - h.score) < 1e-5 for h in hits)  # re-ranked with the exact score
    index.close()


def test_pca_projection_keeps_inner_product_rankings(tmp_path: Path, bundle: Bundle):
    """"PCA<d>" projects without centring: the candidates of a projected index still follow v . s."""
    rng = np.random.default_rng(11)
    index = ImageIndex.create(tmp_path / "pca", bundle)
    latent = rng.standard_normal((60, F, 8)).astype(np.float32)
    lift = rng.standard_normal((8, H)).astype(np.float32)
    vecs = latent @ lift + 2.0  # rank 8 + a common offset (a bias, as v = W x + b has)
    index.add(embedded_images(vecs, np.zeros((60, F, 4)), np.tile([1, 1], (60, 1))), [str(i) for i in range(60)],
              [str(i) for i in range(60)], read_places=False)
    index.rebuild(IndexSettings.of(kind="ivf", nlist=4, nprobe=4, pretransform="PCA9", train_size=100, k_prime=10))
    assert index.candidates.trained
    queries = np.maximum(rng.standard_normal((6, 8)).astype(np.float32) @ lift, 0)
    _, found = index.candidates.search(queries, 10)
    exact = np.argsort(-(queries @ vecs.reshape(-1, H).T), axis=1)[:, :10]
    as_ids = fid.encode(exact // F, exact % F)
    assert np.mean([len(set(a) & set(b)) for a, b in zip(found, as_ids, strict=True)]) >= 9
    index.close()


# -- concurrency ------------------------------------------------------------------------------------------
def test_concurrent_searches_during_adds_see_whole_states(faiss_index: ImageIndex, bundle: Bundle):
    sent, _ = embed_sentence(bundle, QUERIES[2])
    k = 5
    base = ranking(faiss_index.search(QUERIES[2], k, exhaustive=True).hits)
    direction = sent.sum(0) / np.linalg.norm(sent.sum(0))
    adds = [np.repeat(direction[None, None] * (50 + 20 * i), F, axis=1) for i in range(6)]  # each beats the last
    base_ids = [i for i, _ in base]
    # after add i the new images lead (latest first), then the old top
    states = [base_ids] + [([40 + j for j in range(i, -1, -1)] + base_ids)[:k] for i in range(len(adds))]
    seen: list[list[tuple[int, float]]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append(ranking(faiss_index.search(EmbeddedSentence(sent), k).hits))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for i, vec in enumerate(adds):
        faiss_index.add(embedded_images(vec, np.zeros((1, F, 4)), np.array([[1, 1]])), [f"n{i}"], [f"/n{i}"],
                        read_places=False)
        if i == 2:
            faiss_index.save()
        time.sleep(0.02)  # let the readers run between the writes
    stop.set()
    for t in threads:
        t.join()
    assert not errors and len(seen) > len(adds)

    assert all([i for i, _ in r] in states for r in seen)
    assert len({tuple(i for i, _ in r) for r in seen}) >= 3  # the readers did run between the writes
    last = faiss_index.search(EmbeddedSentence(sent), k).hits
    assert [i for i, _ in ranking(last)] == states[-1] == [45, 44, 43, 42, 41]


# -- sentences ----------------------------------------------------------------------------------------------
SENTENCES = ["a red dog runs on the grass", "a man plays with a ball in the street", "a small cat sits near water",
             "a dog", "a woman is on a blue boat", "the white ball is big", "a black cat jumps at a man",
             "a yellow square beside a green circle", "qqqq zzzz", "", "a dog and a cat are in the water"]


def test_sentence_index_annotates_images_like_the_exhaustive_ranking(tmp_path: Path, bundle: Bundle,
                                                                      extractor: RegionExtractor,
                                                                      backend: BackendOptions):
    index = SentenceIndex.create(tmp_path / "sentences", bundle, IndexSettings.of(k_prime=16), backend=backend)
    ids = index.add(SENTENCES * 3)
    assert len(ids) == 27 and len(index) == 27  # the empty and the unknown-word sentences are skipped
    rec = index.get(ids[0])
    assert rec is not None and rec.text == SENTENCES[0] and "amod(dog, red)" in rec.triplets
    upload = picture((220, 30, 30), "circle", (300, 200))
    frags = extractor.extract(upload)
    fast = index.annotate(frags, 6).hits
    assert ranking(fast) == ranking(index.annotate(frags, 6, exhaustive=True).hits)
    assert ranking(index.annotate(upload, 6).hits) == ranking(fast)
    for hit in fast:
        assert hit.text in SENTENCES and hit.alignment
        for m in hit.alignment:
            assert 0 <= m.box[0] < m.box[2] <= 300 and 0 <= m.box[1] < m.box[3] <= 200
            assert m.box == [float(v) for v in frags.boxes[m.fragment]]
    index.remove(fast[0].sentence_id)
    index.save()
    loaded = SentenceIndex.load(index.root, bundle)
    assert ranking(loaded.annotate(frags, 5).hits) == ranking(fast[1:6])
    loaded.close()
    index.close()


def test_a_float16_candidate_copy_halves_the_flat_index_and_annotates_alike(tmp_path: Path, bundle: Bundle,
                                                                           extractor: RegionExtractor):
    """candidate_dtype float16 (FAISS SQfp16): the flat candidate copy holds half the bytes; the positive-score
    candidates (k' = 0, the sentence index's default) read it in float16 and the exact re-rank the store, so an
    annotation ranks as with the float32 copy, saved and loaded."""
    frags = extractor.extract(picture((220, 30, 30), "circle", (300, 200)))
    rankings, sizes = [], []
    for dtype in ("float32", "float16"):
        settings = DEFAULT_SENTENCE_SETTINGS.with_shape(candidate_dtype=dtype)
        index = SentenceIndex.create(tmp_path / dtype, bundle, settings)
        index.add(SENTENCES * 3)
        index.save()
        stored = index.candidates._flat_vectors()
        assert stored is not None and stored[0].dtype == np.dtype(dtype), "the positive scores read the copy"
        sizes.append(faiss.serialize_index(index.candidates.index).nbytes)
        rankings.append(ranking(index.annotate(frags, 8).hits))
        index.close()
        loaded = SentenceIndex.load(tmp_path / dtype, bundle)
        assert loaded.settings.shape.candidate_dtype == dtype
        assert ranking(loaded.annotate(frags, 8).hits) == rankings[-1]
        loaded.close()
    assert rankings[0] == rankings[1] and len(rankings[0]) == 8
    assert sizes[1] < 0.6 * sizes[0], sizes
    with pytest.raises(ValueError, match="flat index"):
        IndexSettings.of(kind="hnsw", candidate_dtype="float16")


def test_two_branch_model_indexes_one_vector_per_image_and_sentence(tmp_path: Path, words: WordTable):
    from fragsearch.model.fragments import SENTENCE_REL
    from fragsearch.training.nets.encoders import TwoBranch

    cfg = TextConfig(sentence_fragment=True)
    relations = RelationVocab(TextPipeline.relation_names(cfg, RELATIONS), {}, 0.01)
    torch.manual_seed(0)
    model = TwoBranch(ModelConfig(kind="two-branch", h=16, hidden=32, n_relations=len(relations)))
    two = Checkpoint(model.eval(), TextPipeline(cfg, relations, words), IMAGE_CFG).bundle()
    images = ImageIndex.create(tmp_path / "tb-images", two)
    feats = np.random.default_rng(12).standard_normal((12, F, 1280)).astype(np.float32)
    vecs = two.embed_images(feats)  # (12, 1, 16): the one global vector
    images.add(embedded_images(vecs, np.tile([0.0, 0, 9, 9], (12, 1, 1)), np.tile([9, 9], (12, 1))),
               [str(i) for i in range(12)], [str(i) for i in range(12)], read_places=False)
    hits = images.search(QUERIES[0], 5).hits
    assert ranking(hits) == ranking(images.search(QUERIES[0], 5, exhaustive=True).hits)
    assert all(m.relation == SENTENCE_REL and m.fragment == 0 for h in hits for m in h.alignment)
    sentences = SentenceIndex.create(tmp_path / "tb-sentences", two)
    sentences.add(SENTENCES)
    rec = sentences.get(0)
    assert rec is not None and len(rec.triplets) == 1 and rec.triplets[0].startswith(SENTENCE_REL)
    query = EmbeddedImage(vecs[0], np.zeros((1, 4)), 0, 0)
    found = sentences.annotate(query, 3).hits
    assert ranking(found) == ranking(sentences.annotate(query, 3, exhaustive=True).hits)
    images.close()
    sentences.close()


def test_sentence_fragments_shared_by_many_sentences_are_held_once(tmp_path: Path, bundle: Bundle,
                                                                    backend: BackendOptions):
    index = SentenceIndex.create(tmp_path / "shared", bundle, IndexSettings.of(k_prime=4), backend=backend)
    ids = index.add(SENTENCES * 3)
    store = index.store
    distinct = {tuple(r) for i in ids for r in store.rows(int(index.items.seg[i]), int(index.items.off[i]),
                                                               int(index.items.n[i])).tolist()}
    assert index.candidates.ntotal == len(distinct) < index.n_fragments
    img = index.store.rows(int(index.items.seg[ids[0]]), int(index.items.off[ids[0]]), 3).copy()
    hits = index.annotate(EmbeddedImage(img, np.zeros((3, 4)), 0, 0), 3).hits
    assert ranking(hits) == ranking(index.annotate(EmbeddedImage(img, np.zeros((3, 4)), 0, 0), 3, exhaustive=True).hits)
    copies = [i for i in ids if name_text(index, i) == hits[0].text]
    assert sorted(h.sentence_id for h in hits) == copies  # the three copies of the best sentence tie
    # the default candidate stage: every sentence fragment with a positive score, the best 5 re-ranked
    index.set_search(k_prime=0, rerank=5)
    for row in range(4):
        first = ids[row]
        query = index.store.rows(int(index.items.seg[first]), int(index.items.off[first]), 2).copy()
        query = query + 0.5 * np.random.default_rng(row).standard_normal(query.shape).astype(np.float32)
        assert ranking(index.annotate(EmbeddedImage(query, np.zeros((2, 4)), 0, 0), 5).hits) == ranking(
            index.annotate(EmbeddedImage(query, np.zeros((2, 4)), 0, 0), 5, exhaustive=True).hits)
    index.set_search(k_prime=4, rerank=0)
    # removing the copy that holds the FAISS entries hands them to the next copy
    assert index.remove(copies[0])
    assert index.candidates.ntotal == len(distinct)
    assert [h.sentence_id for h in index.annotate(EmbeddedImage(img, np.zeros((3, 4)), 0, 0), 2).hits] == copies[1:]
    index.save()
    loaded = SentenceIndex.load(index.root, bundle)
    assert loaded.candidates.ntotal == len(distinct)
    assert [h.sentence_id for h in loaded.annotate(EmbeddedImage(img, np.zeros((3, 4)), 0, 0), 2).hits] == copies[1:]
    for i in copies[1:]:
        loaded.remove(i)
    assert all(h.text != hits[0].text for h in loaded.annotate(EmbeddedImage(img, np.zeros((3, 4)), 0, 0), 30).hits)
    loaded.save()
    again = SentenceIndex.load(index.root, bundle)
    assert again.candidates.ntotal == loaded.candidates.ntotal and len(again) == len(ids) - 3
    again.close()
    loaded.close()
    index.close()


# -- command line -------------------------------------------------------------------------------------------
def test_build_cli_indexes_a_folder_and_captions(tmp_path: Path, bundle: Bundle, backend: BackendOptions):
    photos = tmp_path / "photos"
    photos.mkdir()
    for name, colour, shape in (("a.jpg", (220, 30, 30), "circle"), ("b.jpg", (30, 60, 220), "square")):
        picture(colour, shape).save(photos / name)
    captions = tmp_path / "captions.txt"
    captions.write_text("a.jpg#0\ta red circle .\na.jpg#1\tthe red ball\nb.jpg#0\ta blue square\n")
    split = tmp_path / "train.txt"
    split.write_text("a.jpg\n")
    model = tmp_path / "model.pt"
    bundle.save(model)
    loaded_model = Bundle.load(model)
    out = tmp_path / "index" / "images-all"
    args = ["--model", str(model), "--images", str(photos), "--out", str(out), "--captions", str(captions),
            "--split", str(split), "--cache", str(exported(tmp_path / "cache", bundle.image_cfg)), "--workers", "1",
            "--backend", backend.backend]
    build_main(args)
    images = ImageIndex.load(out, loaded_model)
    sentences = SentenceIndex.load(tmp_path / "index" / "sentences-train", loaded_model)
    assert len(images) == 2 and len(sentences) == 2
    assert {name_of(images, i) for i in images.ids()} == {"a.jpg", "b.jpg"}
    assert len(images.search("a red circle", 2).hits) == 2
    images.close()
    picture((30, 170, 60), "circle").save(photos / "c.jpg")
    build_main(args)  # extends the image index with the new file only
    images = ImageIndex.load(out, loaded_model)
    assert sorted(name_of(images, i) for i in images.ids()) == ["a.jpg", "b.jpg", "c.jpg"]
    images.close()
    sentences.close()


def test_interrupted_sentence_build_leaves_no_index_behind(tmp_path: Path, bundle: Bundle,
                                                           monkeypatch: pytest.MonkeyPatch):
    from fragsearch.index.build import build_sentence_index

    def crash(self: SentenceIndex, *args: object, **kwargs: object) -> list[int]:
        raise KeyboardInterrupt

    out = tmp_path / "sentences"
    monkeypatch.setattr(SentenceIndex, "add", crash)
    with pytest.raises(KeyboardInterrupt):
        build_sentence_index(bundle, ["a dog runs", "a red ball"], out, IndexSettings())
    assert not out.exists()  # a later start builds it again instead of reusing a half-filled one
    monkeypatch.undo()
    index = build_sentence_index(bundle, ["a dog runs", "a red ball"], out, IndexSettings())
    assert len(index) == 2
