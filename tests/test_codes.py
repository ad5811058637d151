"""Prescore codes (index/codes.py): candidates scored on compact codes before the exact re-rank of
the best few. On a small collection with the candidate stage on (exact_below=0): the codes keep the
exact ranking, are derived for an index built without them (`add_codes`) and at every save (new
rows, merged segments), survive a reload, and a crash while they are written keeps the last commit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fragsearch.index.codes
import fragsearch.index.store
from fragsearch.index import ImageIndex, IndexLoadError, IndexSettings
from fragsearch.index.images import embedded_images
from fragsearch.model.bundle import Bundle
from fragsearch.model.embed import EmbeddedImage, embed_sentence
from fragsearch.model.score import skl_of_items
from fragsearch.model.words import WordTable
from tests.test_index import QUERIES, WORDS, F, H, make_bundle, one_thread, ranking  # noqa: F401

N = 240
CODES = 16  # of H = 32 dimensions
RERANK = 20


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return make_bundle(WordTable.build(WORDS))


def vector_images(vecs: np.ndarray, boxes: np.ndarray, sizes: np.ndarray, names: list[str], paths: list[str]
                  ) -> tuple[list[EmbeddedImage], list[str], list[str]]:
    """Arrays of embedded images as `ImageIndex.add` takes them, with their names and paths."""
    return embedded_images(vecs, boxes, sizes), names, paths


def images(n: int = N, seed: int = 11) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[str]]:
    """Fragments with the structure of real ones: most of their energy on a few directions (a rank-10
    part plus smaller noise), stored as float16."""
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((10, H))
    vecs = rng.standard_normal((n, F, 10)) @ basis + 0.3 * rng.standard_normal((n, F, H))
    vecs = vecs.astype(np.float16).astype(np.float32)
    boxes = np.tile(np.array([0, 0, 100, 80], np.float32), (n, F, 1))
    paths = [f"/photos/c{seed}-{k:04d}.jpg" for k in range(n)]
    return vecs, boxes, np.tile([100, 80], (n, 1)), [Path(p).name for p in paths], paths


def candidates_on(ix: ImageIndex, rerank: int = RERANK) -> None:
    """The candidate stage with every fragment recalled, the exact re-rank limited to `rerank` items."""
    ix.set_search(exact_below=0, k_prime=ix.candidates.ntotal + 1, rerank=rerank)


def agreement(ix: ImageIndex) -> float:
    shared = []
    for q in QUERIES:
        exact = [i for i, _ in ranking(ix.search(q, 10, exhaustive=True).hits)]
        found = [i for i, _ in ranking(ix.search(q, 10).hits)]
        shared.append(len(set(exact) & set(found)) / 10)
    return float(np.mean(shared))


def code_files(root: Path) -> list[Path]:
    return sorted(root.glob("codes-*.npy"))


def test_codes_prescore_keeps_the_exact_ranking_reading_only_the_rerank_items(tmp_path: Path, bundle: Bundle):
    ix = ImageIndex.create(tmp_path / "idx", bundle, IndexSettings.of(store_dtype="float16", codes=CODES))
    ix.add(*vector_images(*images()), read_places=False)
    ix.save()
    assert ix.codes is not None and ix.codes.dim == CODES and ix.codes.segments == len(ix.store.segments)
    assert ix.codes.store.bytes_per_row == CODES + 4
    candidates_on(ix)
    page = ix.search(QUERIES[0], 10, 0)
    assert page.considered == RERANK  # every item was a candidate; only the RERANK best by codes were read
    with_codes = agreement(ix)
    assert with_codes >= 0.9
    # the codes' approximate score is S_kl of the projected vectors: close to the exact one
    sent = embed_sentence(bundle, QUERIES[1])[0]
    items = ix.ids()
    approx = ix.codes.scores(ix.items, items, sent, skl_of_items)
    vecs, mask = ix.stored.vectors(items)
    exact = bundle.scores(vecs, mask, sent[None], np.ones((1, len(sent)), np.float32))[:, 0]
    assert np.corrcoef(approx, exact)[0, 1] > 0.95
    # without codes the same re-rank limit keeps the candidates by their partial score instead
    plain = ImageIndex.create(tmp_path / "plain", bundle, IndexSettings.of(store_dtype="float16"))
    plain.add(*vector_images(*images()), read_places=False)
    plain.save()
    candidates_on(plain)
    assert plain.codes is None and plain.search(QUERIES[0], 10, 0).considered == RERANK
    assert with_codes >= agreement(plain)
    ix.close()
    plain.close()


def test_add_codes_derives_them_for_an_index_built_without_and_every_save_keeps_them(tmp_path: Path,
                                                                                      bundle: Bundle):
    root = tmp_path / "idx"
    ix = ImageIndex.create(root, bundle, IndexSettings.of(store_dtype="float16"))
    for part in range(3):  # three saved segments
        vecs, boxes, sizes, names, paths = images(80, seed=part)
        ix.add(embedded_images(vecs, boxes, sizes), names, paths, read_places=False)
        ix.save()
    assert ix.codes is None and not code_files(root)
    candidates_on(ix, rerank=0)
    before = [ranking(ix.search(q, 10).hits) for q in QUERIES]
    ix.add_codes(CODES)
    assert ix.codes is not None and ix.codes.segments == 3 and len(code_files(root)) == 4  # + the projection
    ix.close()
    again = ImageIndex.load(root, bundle)
    assert again.settings.shape.codes == CODES and again.codes is not None and again.codes.segments == 3
    candidates_on(again, rerank=0)
    assert [ranking(again.search(q, 10).hits) for q in QUERIES] == before  # codes change no exact score
    candidates_on(again, rerank=40)
    assert agreement(again) >= 0.9
    # rows added since the last save have no codes yet: they are scored exactly, so they are found
    vecs, boxes, sizes, names, paths = images(1, seed=99)
    target = embed_sentence(bundle, QUERIES[2])[0]
    vecs[0] = np.resize(target, (F, H)) * 1000  # an image made of the query's fragments: the best match
    new = again.add(embedded_images(vecs, boxes, sizes), names, paths, read_places=False)[0]
    assert again.search(QUERIES[2], 1).hits[0].image_id == new
    again.save()  # the new segment gets its codes; the projection and the older codes are kept
    assert again.codes is not None and again.codes.segments == len(again.store.segments) == 4
    assert again.search(QUERIES[2], 1).hits[0].image_id == new
    for i in range(20):  # enough saves to merge segments (index.compaction): the merged one is coded anew
        again.add(*vector_images(*images(2, seed=200 + i)), read_places=False)
        again.save()
    assert again.codes.segments == len(again.store.segments) <= 17
    assert len(code_files(root)) == again.codes.segments + 1  # no code file of a dropped segment is left
    assert agreement(again) >= 0.9
    again.close()


def test_a_crash_while_codes_are_written_keeps_the_last_commit(tmp_path: Path, bundle: Bundle,
                                                               monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "idx"
    ix = ImageIndex.create(root, bundle, IndexSettings.of(store_dtype="float16"))
    ix.add(*vector_images(*images()), read_places=False)
    ix.save()

    class Crash(BaseException):
        pass

    monkeypatch.setattr(fragsearch.index.codes, "ENCODE_ROWS", 64)
    real_encode = fragsearch.index.store.VectorStore.encode
    calls = 0

    def crash_midway(self: fragsearch.index.store.VectorStore, vecs: np.ndarray) -> np.ndarray:
        nonlocal calls
        if self.dim == CODES:
            calls += 1
            if calls == 3:  # two chunks of codes written, then the process dies
                raise Crash
        return real_encode(self, vecs)

    monkeypatch.setattr(fragsearch.index.store.VectorStore, "encode", crash_midway)
    with pytest.raises(Crash):
        ix.add_codes(CODES)
    after = ImageIndex.load(root, bundle)  # what a restart sees: the last commit, without codes
    assert after.codes is None and after.settings.shape.codes == 0 and len(after) == N
    assert not code_files(root)  # the codes being written were temp files, removed when the write failed
    after.add_codes(CODES)
    assert after.codes is not None and len(code_files(root)) == 2
    after.close()


def test_a_missing_code_file_is_a_load_error(tmp_path: Path, bundle: Bundle):
    root = tmp_path / "idx"
    ix = ImageIndex.create(root, bundle, IndexSettings.of(codes=CODES))
    ix.add(*vector_images(*images(60)), read_places=False)
    ix.save()
    ix.close()
    segment = [p for p in code_files(root) if "projection" not in p.name][0]
    segment.unlink()
    with pytest.raises(IndexLoadError, match="prescore code file"):
        ImageIndex.load(root, bundle)


def test_the_partial_selection_keeps_the_sorted_top_k_with_ties_to_the_smaller_id():
    """`best_positions` (the prescore's cut) and `group_items` (its per-item sums) give what a full sort
    and np.unique give, ties and both of group_items' paths included."""
    from fragsearch.index.ranker import group_items, top_k
    from fragsearch.index.selection import best_positions

    rng = np.random.default_rng(0)
    for trial in range(30):
        n = int(rng.integers(1, 300))
        scores = rng.integers(0, 6, n).astype(np.float64)  # many ties
        items = rng.permutation(10 * n)[:n]
        for k in (1, 5, n // 2, n, n + 3):
            want = sorted(p for p, _, _ in top_k(scores, items, k))
            assert best_positions(scores, items, k).tolist() == want, (trial, k)
        ids = rng.integers(0, 50 if trial % 2 else 100_000, 400)
        weights = rng.random(400)
        uniq, where = np.unique(ids, return_inverse=True)
        got_ids, got_sums = group_items(ids, weights, int(ids.max()) + 1)
        np.testing.assert_array_equal(got_ids, uniq)
        np.testing.assert_allclose(got_sums, np.bincount(where, weights=weights))


REFINE_CODES = 8  # the refining codes: 8 more of the H = 32 dimensions


def test_refining_codes_score_the_first_codes_best_on_more_directions(tmp_path: Path, bundle: Bundle,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """The refining codes are derived with the first ones on the directions the first projection leaves
    out, survive a reload, score closer to the exact S_kl than the first codes alone, and a search
    with `refine` N scores the N best by the first codes again on both before the exact re-rank."""
    root = tmp_path / "idx"
    ix = ImageIndex.create(root, bundle, IndexSettings.of(store_dtype="float16", codes=CODES))
    ix.add(*vector_images(*images()), read_places=False)
    ix.save()
    assert ix.codes is not None and ix.codes.refined is None
    first = {p.name for p in code_files(root)}
    ix.add_codes(CODES, REFINE_CODES)  # the first codes kept, the refining ones derived for every segment
    codes = ix.codes
    assert codes is not None and codes.refined is not None and codes.refined.dim == REFINE_CODES
    assert first < {p.name for p in code_files(root)} and len(code_files(root)) == 4
    assert codes.refined.segments == codes.segments == len(ix.store.segments)
    assert codes.refined.store.bytes_per_row == REFINE_CODES + 4
    # orthonormal directions, the refining ones orthogonal to the first
    both = np.concatenate([codes.projection, codes.refined.projection])
    np.testing.assert_allclose(both @ both.T, np.eye(CODES + REFINE_CODES), atol=1e-4)
    ix.close()

    ix = ImageIndex.load(root, bundle)
    codes = ix.codes
    assert codes is not None and codes.refined is not None and ix.settings.shape.refine_codes == REFINE_CODES
    sent = embed_sentence(bundle, QUERIES[1])[0]
    items = ix.ids()
    vecs, mask = ix.stored.vectors(items)
    exact = bundle.scores(vecs, mask, sent[None], np.ones((1, len(sent)), np.float32))[:, 0]
    alone = codes.scores(ix.items, items, sent, skl_of_items)
    refined = codes.scores(ix.items, items, sent, skl_of_items, refined=True)
    assert np.abs(refined - exact).mean() < 0.5 * np.abs(alone - exact).mean()

    scored: list[tuple[int, bool]] = []
    real_scores = fragsearch.index.codes.PrescoreCodes.scores

    def spy(self: fragsearch.index.codes.PrescoreCodes, items_: object, cand: np.ndarray, queries: np.ndarray,
            approx: object, refined: bool = False) -> np.ndarray:
        scored.append((len(cand), refined))
        return real_scores(self, items_, cand, queries, approx, refined)  # type: ignore[arg-type]

    monkeypatch.setattr(fragsearch.index.codes.PrescoreCodes, "scores", spy)
    candidates_on(ix, rerank=10)
    ix.set_search(refine=40)
    page = ix.search(QUERIES[0], 10, 0)
    assert page.considered == 10 and scored == [(N, False), (40, True)]
    with_refine = agreement(ix)
    ix.set_search(refine=0)  # no second step: the first codes alone cut to the re-rank's 10
    scored.clear()
    ix.search(QUERIES[0], 10, 0)
    assert scored == [(N, False)]
    assert with_refine >= agreement(ix) and with_refine >= 0.9
    ix.set_search(refine=2 * N)  # room for every candidate: all scored on both codes, once
    scored.clear()
    ix.search(QUERIES[0], 10, 0)
    assert scored == [(N, True)]
    ix.add_codes(CODES)  # without refining codes again: their files go
    assert ix.codes is not None and ix.codes.refined is None and len(code_files(root)) == 2
    ix.close()


def test_a_missing_refining_code_file_is_a_load_error(tmp_path: Path, bundle: Bundle):
    root = tmp_path / "idx"
    ix = ImageIndex.create(root, bundle, IndexSettings.of(codes=CODES, refine_codes=REFINE_CODES))
    ix.add(*vector_images(*images(60)), read_places=False)
    ix.save()
    ix.close()
    refining = [p for p in root.glob(f"{fragsearch.index.codes.REFINE_PREFIX}-*.npy") if "projection" not in p.name]
    assert len(refining) == 1
    refining[0].unlink()
    with pytest.raises(IndexLoadError, match="prescore code file"):
        ImageIndex.load(root, bundle)


def test_refining_codes_need_first_codes():
    with pytest.raises(ValueError, match="refine_codes"):
        IndexSettings.of(refine_codes=8)
    with pytest.raises(ValueError, match="refine"):
        IndexSettings.of(codes=8, refine=-1)
    with pytest.raises(ValueError, match="shape the stored index"):
        IndexSettings.of(codes=8).with_search(refine_codes=4)


def test_summaries_cut_every_item_to_the_best_few_without_the_candidate_backend(
        tmp_path: Path, bundle: Bundle, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """With `summaries` S, a search scans every live item's summary (its mean first code) and scores the
    S best on their codes; the candidate backend is not searched. Items added since the last save are
    all kept (no codes yet), removed items never come back, and an index saved with the setting
    computes the summaries when it loads."""
    root = tmp_path / "idx"
    ix = ImageIndex.create(root, bundle, IndexSettings.of(store_dtype="float16", codes=CODES))
    vecs, boxes, sizes, names, paths = images()
    half = N // 2
    for part in (slice(0, half), slice(half, N)):  # two store segments, two code files
        ix.add(embedded_images(vecs[part], boxes[part], sizes[part]), names[part], paths[part], read_places=False)
        ix.save()
    codes = ix.codes
    assert codes is not None and codes.segments == 2
    # each item's summary is the mean of its decoded codes
    per_segment = codes.summaries(ix.items)
    ids = np.concatenate([s for s, _ in per_segment])
    assert sorted(ids.tolist()) == ix.ids().tolist()
    seg_ids, means = per_segment[1]
    item = int(seg_ids[3])
    t = ix.items
    own = codes.store.decode(codes.store.gather_rows(t.seg[[item]], t.off[[item]], t.n[[item]]))
    np.testing.assert_allclose(means[3], own.mean(0), rtol=1e-5, atol=1e-6)
    # the score: the linear and the thresholded sums of the means' products, each standardised
    sent = embed_sentence(bundle, QUERIES[2])[0]
    got_ids, got = codes.summary_scores(ix.items, sent)
    dots = np.concatenate([m for _, m in per_segment]) @ codes.project(sent).T
    z = [(x - x.mean()) / x.std() for x in (dots.sum(1), np.maximum(dots, 0).sum(1))]
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_allclose(got, z[0] + z[1], rtol=1e-4, atol=1e-4)
    short_ids, short = codes.summary_scores(ix.items, sent, shortlist=50)  # the 50 best by the linear sum
    best = np.sort(ids[np.argsort(-dots.sum(1), kind="stable")[:50]])
    np.testing.assert_array_equal(short_ids, best)
    within = np.isin(ids, best)
    zs = [(x - x.mean()) / x.std() for x in (dots.sum(1)[within], np.maximum(dots, 0).sum(1)[within])]
    np.testing.assert_allclose(short, zs[0] + zs[1], rtol=1e-4, atol=1e-4)

    scored: list[int] = []
    real_scores = fragsearch.index.codes.PrescoreCodes.scores

    def spy(self: fragsearch.index.codes.PrescoreCodes, items_: object, cand: np.ndarray, queries: np.ndarray,
            approx: object, refined: bool = False) -> np.ndarray:
        scored.append(len(cand))
        return real_scores(self, items_, cand, queries, approx, refined)  # type: ignore[arg-type]

    def backend_searched(*args: object, **kwargs: object) -> None:
        raise AssertionError("the candidate backend was searched")

    candidates_on(ix, rerank=10)
    without = agreement(ix)
    ix.set_search(summaries=80)
    monkeypatch.setattr(fragsearch.index.codes.PrescoreCodes, "scores", spy)
    monkeypatch.setattr(ix.candidates, "search", backend_searched)
    monkeypatch.setattr(ix.candidates, "search_items", backend_searched)
    page = ix.search(QUERIES[0], 10, 0)
    assert page.considered == 10 and scored == [80]  # 80 of 240 scored on codes, 10 read in full
    with_summaries = agreement(ix)
    assert with_summaries >= 0.8 and with_summaries >= without - 0.1
    # added since the last save: no codes, all kept beside the 10
    extra = images(5, seed=12)
    ix.add(*vector_images(*extra), read_places=False)
    assert ix.search(QUERIES[0], 10, 0).considered == 15
    top = ix.search(QUERIES[0], 1).hits[0].image_id
    assert ix.remove(top)
    assert top not in [h.image_id for h in ix.search(QUERIES[0], 50).hits]
    ix.save()
    ix.close()
    monkeypatch.undo()
    with caplog.at_level("INFO", logger="fragsearch.index.base"):
        ix = ImageIndex.load(root, bundle)
    assert ix.settings.search.summaries == 80 and "item summaries of" in caplog.text
    assert ix.codes is not None and ix.codes.segments == 3
    assert top not in np.concatenate([s for s, _ in ix.codes.summaries(ix.items)]).tolist()
    ix.close()


def test_summaries_is_a_search_setting():
    with pytest.raises(ValueError, match="summaries"):
        IndexSettings.of(summaries=-1)
    assert IndexSettings.of(codes=8).with_search(summaries=100).search.summaries == 100
