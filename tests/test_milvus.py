"""The Milvus candidate backend on milvus-lite: index types, crash reconciliation, rebuilds, the local server.

The search behaviour shared with FAISS is tested by tests/test_index.py and the service tests,
parametrized by backend; these are the parts only Milvus has.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psutil
import pytest

from fragsearch.index import ImageIndex, IndexSettings, SentenceIndex
from fragsearch.index import ids as fid
from fragsearch.index.milvus import DIRTY_MARKER, ITEM, LITE_FILE, MilvusCandidates, among, index_spec, stored_count
from fragsearch.index.types import BackendOptions
from fragsearch.model.bundle import Bundle
from fragsearch.model.words import WordTable
from tests.test_index import QUERIES, SENTENCES, WORDS, make_bundle, random_images, ranking, recall_all

MILVUS = BackendOptions("milvus")


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return make_bundle(WordTable.build(WORDS))


def listening(port: int) -> list[str]:
    """Local addresses listening on TCP `port`."""
    return [c.laddr.ip for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]


def test_index_kinds_map_onto_milvus_index_types():
    assert index_spec(IndexSettings()) == ("FLAT", {}, {})
    assert index_spec(IndexSettings.of(kind="hnsw", hnsw_m=16, ef_construction=80, ef_search=64)) == (
        "HNSW", {"M": 16, "efConstruction": 80}, {"ef": 64})
    assert index_spec(IndexSettings.of(kind="ivf", nlist=256, nprobe=8)) == ("IVF_FLAT", {"nlist": 256}, {"nprobe": 8})
    assert index_spec(IndexSettings.of(kind="ivfpq", nlist=64, m=8, nbits=8, nprobe=4)) == (
        "IVF_PQ", {"nlist": 64, "m": 8, "nbits": 8}, {"nprobe": 4})
    with pytest.raises(ValueError, match="pre-transform"):
        index_spec(IndexSettings.of(kind="ivf", pretransform="PCA16"))


def test_milvus_lite_refuses_ivfpq_and_keeps_no_half_made_index(tmp_path: Path, bundle: Bundle):
    with pytest.raises(ValueError, match="IVF_PQ"):
        ImageIndex.create(tmp_path / "pq", bundle, IndexSettings.of(kind="ivfpq", m=8), backend=MILVUS)


def test_ivf_on_milvus_agrees_with_the_exact_ranking(tmp_path: Path, bundle: Bundle):
    index = ImageIndex.create(tmp_path / "ivf", bundle, IndexSettings.of(kind="ivf", nlist=4, nprobe=4), backend=MILVUS)
    random_images(index, 60, seed=8)
    index.save()
    recall_all(index)
    for q in QUERIES:
        assert ranking(index.search(q, 10).hits) == ranking(index.search(q, 10, exhaustive=True).hits), q
    index.close()


def test_a_writer_that_died_before_its_commit_took_no_committed_rows_and_is_reconciled_at_the_next_write(
        tmp_path: Path, bundle: Bundle):
    index = ImageIndex.create(tmp_path / "crash", bundle, backend=MILVUS)
    random_images(index, 30, seed=9)
    index.save()
    committed = index.ids().tolist()
    assert not (index.root / DIRTY_MARKER).exists()
    # uncommitted additions reach the collection at once, removals wait for the commit; the process
    # "dies" (no save) after them
    random_images(index, 6, seed=10)
    removed = [int(committed[3]), int(committed[17])]
    for i in removed:
        index.remove(i)
    cand = index.candidates
    assert isinstance(cand, MilvusCandidates)
    assert (index.root / DIRTY_MARKER).exists() and cand.ntotal == (30 + 6 - 2) * 5
    assert stored_count(cand.client, cand.collection) == (30 + 6) * 5, "the removed rows wait for the commit"
    vecs, _ = index.stored.vectors(np.asarray(removed))
    _, hits = cand.search_items(vecs[:, 0], 40)  # the removed items' own fragments as queries
    assert not set((hits[hits >= 0] >> fid.FRAGMENT_BITS).tolist()) & set(removed), "removed rows searched"
    index.close()
    loaded = ImageIndex.load(index.root, bundle)
    assert loaded.ids().tolist() == committed and loaded.candidates.ntotal != loaded.n_fragments
    cand = loaded.candidates
    assert isinstance(cand, MilvusCandidates)
    assert stored_count(cand.client, cand.collection, where=among(ITEM, committed)) == 30 * 5, \
        "every committed row is in the collection before any write"
    recall_all(loaded)
    # searches before any write: only committed items come back, as the exact ranking over them
    for q in QUERIES:
        assert {h.image_id for h in loaded.search(q, 40).hits} <= set(committed)
    loaded.save()  # the first write reconciles: the collection holds the committed state exactly
    assert loaded.candidates.ntotal == loaded.n_fragments == 30 * 5
    assert not (loaded.root / DIRTY_MARKER).exists()
    for q in QUERIES:
        assert ranking(loaded.search(q, 10).hits) == ranking(loaded.search(q, 10, exhaustive=True).hits), q
    loaded.close()


def test_a_rebuild_fills_a_new_collection_and_the_commit_drops_the_old_one(tmp_path: Path, bundle: Bundle):
    index = ImageIndex.create(tmp_path / "rebuild", bundle, backend=MILVUS)
    random_images(index, 25, seed=11)
    index.save()
    assert isinstance(index.candidates, MilvusCandidates)
    first = index.candidates.collection
    index.rebuild(IndexSettings.of(kind="hnsw", ef_search=64))
    second = index.candidates
    assert isinstance(second, MilvusCandidates) and second.collection != first
    assert set(second.client.list_collections()) == {first, second.collection}  # the old one until the commit
    index.save()
    assert second.client.list_collections() == [second.collection]
    index.close()
    loaded = ImageIndex.load(tmp_path / "rebuild", bundle)
    assert loaded.settings.shape.kind == "hnsw" and loaded.candidates.ntotal == 25 * 5
    recall_all(loaded)
    for q in QUERIES:
        assert ranking(loaded.search(q, 10).hits) == ranking(loaded.search(q, 10, exhaustive=True).hits), q
    loaded.close()


def test_an_index_built_on_milvus_is_not_opened_as_faiss(tmp_path: Path, bundle: Bundle):
    from fragsearch.index import IndexLoadError

    SentenceIndex.create(tmp_path / "s", bundle, backend=MILVUS).close()
    with pytest.raises(IndexLoadError, match="milvus"):
        SentenceIndex.load(tmp_path / "s", bundle, backend=BackendOptions("faiss"))
    with SentenceIndex.load(tmp_path / "s", bundle) as index:  # no options: the backend it was built with
        assert index.candidates.NAME == "milvus" and len(index.add(SENTENCES[:3])) == 3


def test_milvus_lite_listens_on_loopback_only_and_stops_with_its_last_index(tmp_path: Path, bundle: Bundle):
    from milvus_lite.server_manager import server_manager_instance

    images = ImageIndex.create(tmp_path / "a", bundle, backend=MILVUS)
    again = ImageIndex.load(tmp_path / "a", bundle)  # a second user of the same folder: one server
    path = str((tmp_path / "a" / LITE_FILE).resolve())
    uri = server_manager_instance.start_and_get_uri(path)  # the running server's address (not a new one)
    assert uri is not None and uri.startswith("http://127.0.0.1:")
    port = int(uri.rsplit(":", 1)[1])
    addresses = listening(port)
    # 127.0.0.1, or its IPv4-mapped IPv6 form
    assert addresses and all(a in ("127.0.0.1", "::ffff:127.0.0.1") for a in addresses)
    images.close()
    assert listening(port)  # still used by `again`
    again.close()
    assert listening(port) == []
    np.testing.assert_equal(images.root.is_dir(), True)


def test_an_installation_without_the_milvus_extra_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`pip install .` alone has no pymilvus: asking for the Milvus backend, or opening an index kept
    in Milvus, says which extra to install instead of failing on a bare import inside the backend."""
    import importlib.util

    import fragsearch.index.backends

    real = importlib.util.find_spec
    monkeypatch.setattr(fragsearch.index.backends.importlib.util, "find_spec",
                        lambda name, *a: None if name == "pymilvus" else real(name, *a))
    with pytest.raises(ImportError, match=r"milvus extra \(pip install 'fragsearch\[milvus\]'"):
        fragsearch.index.backends.create_backend(tmp_path, 8, IndexSettings(), BackendOptions("milvus"), "images")
    with pytest.raises(ImportError, match="milvus extra"):
        fragsearch.index.backends.open_backend(tmp_path, 8, IndexSettings(), {"backend": "milvus"}, None)
    assert not list(tmp_path.iterdir())  # nothing was written
