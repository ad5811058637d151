"""The Milvus backend against a real Milvus 2.3.5 standalone server: run by tests/test_milvus_server.py
inside a network namespace of its own (loopback only), where this process, the server it starts and
the writer processes it starts share loopback and nothing else.

    pytest -m milvus_server tests/test_milvus_server.py     # how it is run (in the namespace)

The server groups no hits (a 2.3 server ignores `group_by_field`), so the backend groups candidates
itself: compared here with FAISS's exact hits grouped by item and with milvus-lite, which groups on
its side. Then: a search right after a write sees it; the service suite's ranked routes, uploads and
deletes on indexes kept in the server; the date and place filters; a writer killed with the server
alive; the server killed while a writer writes, then started again on its data: every committed item
served, nothing lost.
"""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest

from bench.milvus_local import LocalServer, isolated, links, loopback_up
from fragsearch.index import ImageIndex, IndexSettings, SentenceIndex
from fragsearch.index import ids as fid
from fragsearch.index.images import embedded_images
from fragsearch.index.milvus import ID, VECTOR, MilvusCandidates, search_collection
from fragsearch.index.types import BackendOptions
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.service.engine import Engine
from tests.conftest import ShapesModel
from tests.conftest_service import IMAGE_SETTINGS, SENTENCE_SETTINGS, ServiceEnv, make_settings
from tests.crash_writer import journal_state, live_items
from tests.crash_writer import random_images as writer_images
from tests.test_crash import check_committed_state, kill_trials, start_writer, wait_ready
from tests.test_places import PARIS, SYDNEY, album, album_index, album_search  # noqa: F401  (album: a fixture)
from tests.test_service import (  # noqa: F401  (the service suite's tests, run here on the server's indexes)
    scan_client,
    test_annotate_ranks_the_images_own_captions_high,
    test_every_ranked_route_answers_through_the_candidates_as_the_scan_does,
    test_explain_gives_the_score_rank_and_every_pairs_share,
    test_fragment_search_by_phrase_and_triplet,
    test_health_and_ready,
    test_k_larger_than_the_collection_returns_what_exists,
    test_pages_of_results,
    test_search_finds_the_described_image_with_alignments,
    test_similar_images_ranked_by_mean_fragments_and_explained_by_descriptions,
    test_upload_then_search_then_delete,
    test_writes_persist_across_a_restart,
)

pytest_plugins = ["tests.conftest_service"]
pytestmark = pytest.mark.milvus_server

logger = logging.getLogger(__name__)

CRASH_PORT = 19540  # the port of the server the crash trial kills (the session's stays on 19530)
SERVER_KILLS = 2
WRITER_KILLS = 2


@pytest.fixture(scope="session")
def milvus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """The Milvus server of the session, in this process's network namespace (loopback only)."""
    loopback_up()
    assert isolated(), f"not in a network namespace of its own (links: {links()}): run tests/test_milvus_server.py"
    server = LocalServer(tmp_path_factory.mktemp("milvus"))
    server.start()
    yield server
    server.stop()


def server_options(server: LocalServer) -> BackendOptions:
    return BackendOptions("milvus", server.uri)


# -- the server, its version, and grouping ---------------------------------------------------------------
def fragment_table(seed: int, items: int = 300, frags: int = 20, dim: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Fragment ids (N,) and unit vectors (N, dim) of `items` items whose fragments cluster around the
    item's own direction, so that an item's fragments crowd a query's nearest hits."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((items, 1, dim))
    vecs = (centres + 0.35 * rng.standard_normal((items, frags, dim))).reshape(-1, dim).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    ids = np.concatenate([fid.item_fragments(i, frags) for i in range(items)])
    return ids, vecs


def exact_items(ids: np.ndarray, vecs: np.ndarray, queries: np.ndarray, k: int,
                allowed: np.ndarray | None = None) -> list[list[tuple[int, float]]]:
    """Per query, the k items with the best fragment score and that score: every fragment's exact
    inner product (a FAISS flat index), grouped by item."""
    flat = faiss.IndexFlatIP(vecs.shape[1])
    flat.add(vecs)
    scores, rows = flat.search(queries, len(vecs))
    out = []
    for q in range(len(queries)):
        best: dict[int, float] = {}
        for row, score in zip(rows[q], scores[q], strict=True):
            item = int(ids[row]) >> fid.FRAGMENT_BITS
            if (allowed is None or item in allowed) and item not in best:
                best[item] = float(score)
        out.append(list(best.items())[:k])
    return out


def backend_items(backend: MilvusCandidates, queries: np.ndarray, k: int, allowed: np.ndarray | None = None
                  ) -> list[list[tuple[int, float]]]:
    scores, found = backend.search_items(queries, k, allowed)
    return [[(int(i) >> fid.FRAGMENT_BITS, float(s)) for i, s in zip(found[q], scores[q], strict=True) if i >= 0]
            for q in range(len(queries))]


def assert_same_items(got: list[list[tuple[int, float]]], want: list[list[tuple[int, float]]]) -> None:
    for q, (g, w) in enumerate(zip(got, want, strict=True)):
        assert [i for i, _ in g] == [i for i, _ in w], f"query {q}: other items than the exact grouping"
        np.testing.assert_allclose([s for _, s in g], [s for _, s in w], rtol=1e-4, atol=1e-5)


def test_the_server_runs_in_a_namespace_of_its_own_and_is_told_apart_by_version(milvus: LocalServer,
                                                                                tmp_path: Path) -> None:
    import psutil

    (tmp_path / "v").mkdir()
    assert links() == ["lo"]
    listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert milvus.port in listening  # reached over this namespace's loopback
    backend = MilvusCandidates.create(tmp_path / "v", 8, IndexSettings(), server_options(milvus), "images")
    try:
        assert backend.server_version.startswith("v2.3.5") and not backend.groups_on_server
    finally:
        backend.discard()


def test_a_2_3_server_ignores_group_by_and_the_backend_groups_as_faiss_and_milvus_lite_do(milvus: LocalServer,
                                                                                         tmp_path: Path) -> None:
    ids, vecs = fragment_table(seed=5)
    rng = np.random.default_rng(6)
    queries = vecs[rng.choice(len(vecs), 12, replace=False)] + 0.1 * rng.standard_normal((12, 32)).astype(np.float32)
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    allowed = np.sort(rng.choice(300, 90, replace=False)).astype(np.int64)
    for folder in ("server", "lite"):
        (tmp_path / folder).mkdir()
    server = MilvusCandidates.create(tmp_path / "server", 32, IndexSettings(), server_options(milvus), "images")
    lite = MilvusCandidates.create(tmp_path / "lite", 32, IndexSettings(), BackendOptions("milvus"), "images")
    try:
        for backend in (server, lite):
            backend.add(ids, vecs)
        assert lite.groups_on_server and not server.groups_on_server
        # what the server does with group_by_field: plain fragment hits, items repeated
        raw = search_collection(server.client, server.collection, queries, 50, {}, group=True)
        assert any(len({h["id"] >> fid.FRAGMENT_BITS for h in hits}) < len(hits) for hits in raw)
        for k in (1, 10, 60):  # 60 items need more fragment hits than the first request asks for
            want = exact_items(ids, vecs, queries, k)
            assert_same_items(backend_items(server, queries, k), want)
            assert_same_items(backend_items(lite, queries, k), want)
            filtered = exact_items(ids, vecs, queries, k, allowed)
            assert_same_items(backend_items(server, queries, k, allowed), filtered)
            # milvus-lite 3.2.2 groups a filtered search short of k items at times: what it returns
            # is the start of the exact grouping
            short = backend_items(lite, queries, k, allowed)
            assert_same_items(short, [w[:len(g)] for g, w in zip(short, filtered, strict=True)])
    finally:
        server.discard()
        lite.discard()


def test_a_search_right_after_a_write_sees_it(milvus: LocalServer, tmp_path: Path) -> None:
    """Deleted rows never come back and added rows are found, each by the next search (the backend's
    guarantee timestamp); a 2.3 server at Session or Bounded consistency may return a row just deleted."""
    ids, vecs = fragment_table(seed=7, items=60)
    (tmp_path / "c").mkdir()
    backend = MilvusCandidates.create(tmp_path / "c", 32, IndexSettings(), server_options(milvus), "images")
    try:
        backend.add(ids, vecs)
        for trial in range(6):
            gone = trial * 7 + 1
            query = vecs[gone * 20: gone * 20 + 1]
            assert backend.remove_item(gone) == 20
            _, found = backend.search(query, 5)
            assert gone not in (found[found >= 0] >> fid.FRAGMENT_BITS).tolist(), f"trial {trial}: deleted item found"
            new = 1000 + trial
            fresh = np.roll(query, trial + 1, axis=1)
            backend.add(fid.item_fragments(new, 1), fresh)
            _, found = backend.search(fresh, 1)
            assert int(found[0, 0]) >> fid.FRAGMENT_BITS == new, f"trial {trial}: the added row was not found"
        assert backend.ntotal == 60 * 20 - 6 * 20 + 6
    finally:
        backend.discard()


# -- the service suite on indexes kept in the server ----------------------------------------------------
def build_indexes(shapes: ShapesModel, bundle: Bundle, root: Path, uri: str) -> tuple[ImageIndex, SentenceIndex]:
    """The service suite's indexes (the dev images; the train + dev captions) in new collections of the
    server at `uri`."""
    backend = BackendOptions("milvus", uri)
    dev, train = load_split(shapes.data, "dev"), load_split(shapes.data, "train")
    images = ImageIndex.create(root / "images", bundle, IMAGE_SETTINGS, cache=feature_cache(shapes.cache,
                                                                                             bundle.image_cfg),
                               backend=backend)
    images.photos.add([dev.image_path(n) for n in dev.images])
    images.save()
    sentences = SentenceIndex.create(root / "sentences", bundle, SENTENCE_SETTINGS, backend=backend)
    sentences.add(train.sentences()[0] + dev.sentences()[0])
    sentences.save()
    return images, sentences


@dataclass
class ServerServiceEnv(ServiceEnv):
    """The service suite's environment with its indexes in the Milvus server; a writable copy is a new
    pair of indexes in new collections (a copied folder would share its collection with the original)."""

    uri: str = ""

    def writable(self, tmp: Path, bundle: Bundle | None = None, **overrides: object) -> tuple[Any, Engine]:
        settings = self.settings_for(tmp, **overrides)
        bundle = bundle or self.shapes.bundle
        images, sentences = build_indexes(self.shapes, bundle, tmp, self.uri)
        return settings, Engine(settings, bundle, images, sentences)


@pytest.fixture(scope="session")
def service_env(milvus: LocalServer, shapes_model: ShapesModel,
                tmp_path_factory: pytest.TempPathFactory) -> ServiceEnv:
    """The suite's service environment (tests.conftest_service) with its candidates in the server."""
    root = tmp_path_factory.mktemp("service-milvus-server")
    images, sentences = build_indexes(shapes_model, shapes_model.bundle, root, milvus.uri)
    assert isinstance(images.candidates, MilvusCandidates) and not images.candidates.groups_on_server
    settings = make_settings(shapes_model, root, index_backend="milvus", milvus_uri=milvus.uri)
    dev = load_split(shapes_model.data, "dev")
    captions = {n: list(c) for n, c in zip(dev.images, dev.captions, strict=True)}
    return ServerServiceEnv(root, shapes_model, settings, Engine(settings, shapes_model.bundle, images, sentences),
                            list(dev.images), captions, uri=milvus.uri)


def test_search_filters_by_date_and_place_in_the_server(milvus: LocalServer, shapes_model: ShapesModel,
                                                        tmp_path: Path, album: dict[str, Path],  # noqa: F811
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the candidates: the server gets the allowed ids as a filter expression and the answers
    are the unfiltered ranking's photos that pass, in its order."""
    import fragsearch.index.ranker

    monkeypatch.setattr(fragsearch.index.ranker, "FILTERED_EXACT", 0)
    images = album_index(shapes_model, tmp_path, album, server_options(milvus))
    with album_search(shapes_model, tmp_path, images) as (_, names):
        everything = names()
        assert len(everything) == 5
        assert names(near={"lat": PARIS[0], "lon": PARIS[1], "km": 5}) == [n for n in everything
                                                                            if n.startswith("paris")]
        assert names(taken_after="2024-06-01", taken_before="2024-09-01") == [
            n for n in everything if n in ("paris-july.jpg", "paris-august.jpg", "dated.jpg")]
        assert names(taken_after="2024-07-14T10:30:00", taken_before="2024-07-14T10:30:01") == ["paris-july.jpg"]
        assert names(near={"lat": SYDNEY[0], "lon": SYDNEY[1], "km": 1}) == ["sydney.jpg"]
        assert names(near={"lat": 0, "lon": 0, "km": 1}) == []
        images.remove(images.photos.find([album["paris-july"]])[str(album["paris-july"])])
        images.save()
        assert names(near={"lat": PARIS[0], "lon": PARIS[1], "km": 5}) == ["paris-august.jpg"]
        assert images.searches["candidates"] > 0 and images.searches["scan"] == 0
    images.close()


# -- crashes ----------------------------------------------------------------------------------------------
def crash_index(root: Path, log: Path, shapes: ShapesModel, uri: str) -> None:
    """A flat image index of 8 random images in the server at `uri`, saved once, and its journal."""
    index = ImageIndex.create(root, shapes.bundle, IndexSettings(), backend=BackendOptions("milvus", uri))
    vecs, boxes, sizes = writer_images(np.random.default_rng(99), shapes.bundle.dim, 8)
    index.add(embedded_images(vecs, boxes, sizes), [f"seed-{i}.jpg" for i in range(8)], [f"/x/{i}" for i in range(8)],
              read_places=False)
    index.save()
    journal_state(log, index.generation, live_items(index))
    index.close()


def test_a_writer_killed_with_the_server_alive_leaves_a_committed_state(milvus: LocalServer,
                                                                        shapes_model: ShapesModel,
                                                                        tmp_path: Path) -> None:
    root, log = tmp_path / "index", tmp_path / "journal.jsonl"
    crash_index(root, log, shapes_model, milvus.uri)
    gens = kill_trials(shapes_model, root, log, WRITER_KILLS, seed=3)
    assert gens[-1] > gens[0] or len(set(gens)) > 1, "the writers committed nothing before being killed"


def committed_rows_intact(root: Path, bundle: Bundle) -> int:
    """Before any write: every fragment of every committed item is in the collection, its vector the
    re-rank store's. Returns the committed items."""
    index = ImageIndex.load(root, bundle)
    try:
        cand = index.candidates
        assert isinstance(cand, MilvusCandidates)
        items = index.ids().tolist()
        for item in items:
            want, _ = index.stored.vectors(np.asarray([item]))
            n = int(index.items.n[item])
            frags = fid.item_fragments(int(item), n).tolist()
            rows = cand.client.query(cand.collection, filter=f"{ID} in {frags}", output_fields=[ID, VECTOR])
            got = {int(r[ID]): np.asarray(r[VECTOR], np.float32) for r in rows}
            assert sorted(got) == frags, f"item {item}: committed fragments missing from the server"
            np.testing.assert_allclose(np.stack([got[f] for f in frags]), want[0, :n], rtol=1e-6, atol=1e-6)
        return len(items)
    finally:
        index.close()


def test_the_server_killed_mid_write_serves_every_committed_item_after_its_restart(
        shapes_model: ShapesModel, milvus: LocalServer, tmp_path: Path) -> None:
    """SIGKILL to the server while a writer adds, removes, saves and rebuilds; the writer, left without
    its server, is ended; the server is started again on its data: every committed fragment is there
    with its vector before any write, and the index holds exactly a committed state. The session's server
    is stopped meanwhile (an embedded etcd's peer port is fixed: two servers cannot share a namespace)
    and started again after."""
    milvus.stop()
    server = LocalServer(tmp_path / "milvus", CRASH_PORT)
    server.start()
    try:
        root, log = tmp_path / "index", tmp_path / "journal.jsonl"
        crash_index(root, log, shapes_model, server.uri)
        rng = random.Random(4)
        gens = []
        for trial in range(SERVER_KILLS):
            writer = start_writer(root, shapes_model.model_path, log, 4000 + trial)
            wait_ready(writer)
            time.sleep(rng.uniform(0.5, 2.0))
            server.kill()
            try:  # without its server, the writer cannot commit; it fails or retries until ended
                writer.wait(timeout=3)
            except subprocess.TimeoutExpired:
                writer.send_signal(signal.SIGKILL)
                writer.wait(timeout=30)
            began = time.monotonic()
            healthy = server.start()
            items = committed_rows_intact(root, shapes_model.bundle)
            logger.info("trial %d: server healthy %.1f s after its restart, committed state served after %.1f s "
                        "(%d items)", trial, healthy, time.monotonic() - began, items)
            gens.append(check_committed_state(root, shapes_model, log))
        assert gens[-1] > 1, "the writers committed nothing before the server was killed"
    finally:
        server.stop()
        milvus.start()
