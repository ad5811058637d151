"""A large load in bounded memory (index/store.py's spill file, index/shards.py's grouped commits) and the
int8 re-rank store, on small data: the streamed build equals the in-memory one, a crash mid-load keeps
the last commit, an int8 store keeps the exact ranking."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

import fragsearch.index.store
from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.images import embedded_images
from fragsearch.index.shards import ShardError, ShardWriter, load_shards, shard_files, shard_settings
from fragsearch.index.store import VectorStore
from fragsearch.model.bundle import Bundle
from fragsearch.model.words import WordTable
from tests.test_index import IMAGE_CFG, QUERIES, WORDS, F, H, make_bundle, one_thread, ranking  # noqa: F401

N = 60


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return make_bundle(WordTable.build(WORDS))


def images(n: int = N, seed: int = 3) -> tuple[np.ndarray, np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    vecs = rng.standard_normal((n, F, H)).astype(np.float32).astype(np.float16).astype(np.float32)
    boxes = np.tile(np.array([0, 0, 100, 80], np.float32), (n, F, 1))
    return vecs, boxes, [f"/photos/p{k:03d}.jpg" for k in range(n)]


def write_shards(folder: Path, bundle: Bundle, fingerprint: str, shard_size: int = 7) -> None:
    vecs, boxes, paths = images()
    with ShardWriter(folder, shard_settings(IMAGE_CFG), shard_size, embedded_by=fingerprint, dim=H) as writer:
        for v, b, p in zip(vecs, boxes, paths, strict=True):
            writer.add_vectors(Path(p).name, Path(p).name, p, v, b, 100, 80)


def stored(ix: ImageIndex) -> dict[str, np.ndarray]:
    """path -> the item's stored rows (float32)."""
    found = ix.photos.find(images()[2])
    return {p: np.asarray(ix.stored.rows(i), np.float32) for p, i in found.items()}


def path_of(ix: ImageIndex, image_id: int) -> str:
    record = ix.get(image_id)
    assert record is not None
    return record.path


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_streamed_load_with_spill_equals_the_in_memory_index(tmp_path: Path, bundle: Bundle, kind: str,
                                                             monkeypatch: pytest.MonkeyPatch):
    settings = IndexSettings.of(kind=kind, nlist=4, store_dtype="float16", exact_below=0)
    vecs, boxes, paths = images()
    memory = ImageIndex.create(tmp_path / "memory", bundle, settings)
    with memory.bulk():
        memory.add(embedded_images(vecs, boxes, np.tile([100, 80], (N, 1))), [Path(p).name for p in paths], paths,
                   read_places=False)
    memory.save()
    monkeypatch.setattr(fragsearch.index.store, "SPILL_BYTES", 3 * F * H * 2)  # a spill every few images
    monkeypatch.setattr(fragsearch.index.store, "BLOCK_ROWS", 2 * F)
    spilled: list[int] = []
    real_write = fragsearch.index.store.SpillFile.write

    def write(self: fragsearch.index.store.SpillFile, raw: np.ndarray) -> None:
        spilled.append(len(raw))
        real_write(self, raw)

    monkeypatch.setattr(fragsearch.index.store.SpillFile, "write", write)
    shards = tmp_path / "shards"
    streamed = ImageIndex.create(tmp_path / "streamed", bundle, settings)
    write_shards(shards, bundle, streamed.fingerprint)
    assert load_shards(streamed, shards, chunk=4, progress=False, commit_images=25, remove_loaded=True) == N
    assert shard_files(shards) == []  # every shard was removed once a commit held its images
    assert streamed.generation == 1 + 3  # created, then a commit per group of >= 25 images
    assert streamed.candidates.active_kind == kind and streamed.candidates.ntotal == N * F
    assert sum(spilled) == 2 * 28 * F  # the two groups of 28 images went through spill files (the last 4
    # images stayed under the threshold), which became segments
    assert not list(streamed.root.glob(".*.tmp"))
    got, want = stored(streamed), stored(memory)
    assert sorted(got) == sorted(want) == sorted(paths)
    for p in paths:
        np.testing.assert_array_equal(got[p], want[p])
    streamed.close()
    again = ImageIndex.load(tmp_path / "streamed", bundle)
    for q in QUERIES:
        assert [(path_of(again, i), s) for i, s in ranking(again.search(q, 10, exhaustive=True).hits)] == \
               [(path_of(memory, i), s) for i, s in ranking(memory.search(q, 10, exhaustive=True).hits)]
        if kind == "flat":
            assert ranking(again.search(q, 10).hits) == ranking(again.search(q, 10, exhaustive=True).hits)
    again.close()
    memory.close()


def test_a_crash_mid_load_leaves_the_last_commit_and_the_next_load_resumes(tmp_path: Path, bundle: Bundle,
                                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fragsearch.index.store, "SPILL_BYTES", 2 * F * H * 4)
    monkeypatch.setattr(fragsearch.index.store, "BLOCK_ROWS", F)
    root, shards = tmp_path / "idx", tmp_path / "shards"
    ix = ImageIndex.create(root, bundle, IndexSettings.of(exact_below=0))
    write_shards(shards, bundle, ix.fingerprint)
    real_add = ImageIndex.add
    calls = 0

    class Crash(BaseException):
        pass

    def crash_in_the_second_group(self: ImageIndex, *args: object, **kwargs: object) -> list[int]:
        nonlocal calls
        calls += 1
        if len(self) >= 50:  # the first group (35 images) is committed, 15 of the second added and spilled
            raise Crash
        return real_add(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ImageIndex, "add", crash_in_the_second_group)
    with pytest.raises(Crash):
        load_shards(ix, shards, chunk=5, progress=False, commit_images=30, remove_loaded=True)
    assert list(root.glob(".*store-live*.tmp"))  # the uncommitted rows' spill file is left behind
    monkeypatch.setattr(ImageIndex, "add", real_add)
    after = ImageIndex.load(root, bundle)  # what a restart sees: the last commit
    assert len(after) == 35 and len(shard_files(shards)) == 4  # the first group's 5 shards of 7 are gone
    committed = len(after)
    assert load_shards(after, shards, progress=False, remove_loaded=True) == N - committed
    assert len(after) == N and shard_files(shards) == []
    assert not list(root.glob(".*.tmp"))  # the crashed writer's spill file went with the next save
    assert sorted(after.photos.find(images()[2])) == sorted(images()[2])
    after.close()


def test_embedded_shards_of_another_model_are_refused(tmp_path: Path, bundle: Bundle):
    ix = ImageIndex.create(tmp_path / "idx", bundle)
    write_shards(tmp_path / "s", bundle, "0" * 20)
    with pytest.raises(ShardError, match="another model"):
        load_shards(ix, tmp_path / "s", progress=False)
    with pytest.raises(ValueError, match="holds features"):
        ShardWriter(tmp_path / "f", shard_settings(IMAGE_CFG)).add_vectors("k", "n", "/p", np.zeros((F, H)),
                                                                          np.zeros((F, 4)), 1, 1)
    ix.close()


def test_int8_store_keeps_the_exact_ranking_and_survives_a_reload(tmp_path: Path, bundle: Bundle):
    vecs, boxes, paths = images(200, seed=5)
    built = {}
    for dtype in ("float16", "int8"):
        ix = ImageIndex.create(tmp_path / dtype, bundle, IndexSettings.of(store_dtype=dtype, exact_below=0))
        ix.add(embedded_images(vecs, boxes, np.tile([100, 80], (200, 1))), [Path(p).name for p in paths], paths,
               read_places=False)
        ix.save()
        built[dtype] = ix
    int8 = built["int8"]
    assert int8.store.bytes_per_row == H + 4 and built["float16"].store.bytes_per_row == 2 * H
    rows = np.stack([int8.stored.rows(i) for i in range(200)])
    bound = np.abs(vecs).max(axis=2, keepdims=True) / 254 + 1e-6  # half a quantisation step
    assert (np.abs(rows - vecs) <= bound).all()
    overlap = []
    for q in QUERIES:
        a = [i for i, _ in ranking(built["float16"].search(q, 10, exhaustive=True).hits)]
        b = [i for i, _ in ranking(int8.search(q, 10, exhaustive=True).hits)]
        overlap.append(len(set(a) & set(b)) / 10)
    assert np.mean(overlap) >= 0.9
    int8.close()
    again = ImageIndex.load(tmp_path / "int8", bundle)
    np.testing.assert_array_equal(np.stack([again.stored.rows(i) for i in range(200)]), rows)
    again.close()
    built["float16"].close()


class MadviseRecorder:
    """A segment's mmap that records each madvise (byte ranges by option; page-aligned, inside the map)
    and passes it on."""

    def __init__(self, handle: mmap.mmap) -> None:
        self.handle = handle
        self.calls: dict[int, list[tuple[int, int]]] = {mmap.MADV_WILLNEED: [], mmap.MADV_DONTNEED: []}

    def __getattr__(self, name: str) -> object:
        return getattr(self.handle, name)

    def __len__(self) -> int:
        return len(self.handle)

    def madvise(self, option: int, start: int, length: int) -> None:
        assert start % mmap.PAGESIZE == 0 and start + length <= len(self.handle)
        self.calls[option].append((start, start + length))
        self.handle.madvise(option, start, length)


def test_int8_encoding_round_trips_and_rejects_nothing_it_can_hold():
    store = VectorStore(8, "int8")
    x = np.array([[0.0] * 8, [1, -2, 3, -4, 5, -6, 7, -127], [1e-8] * 8], np.float32)
    y = store.decode(store.encode(x))
    np.testing.assert_allclose(y, x, atol=np.abs(x).max(axis=1, keepdims=True).max() / 254)
    assert (y[0] == 0).all() and y[1, 7] == -127
    np.testing.assert_array_equal(store.decode(store.encode(y)), y)  # a second round is exact


def test_a_sentence_index_refuses_an_int8_store(tmp_path: Path, bundle: Bundle):
    from fragsearch.index import SentenceIndex

    with pytest.raises(ValueError, match="not int8"):
        SentenceIndex.create(tmp_path / "s", bundle, IndexSettings.of(store_dtype="int8"))


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_gather_of_scattered_items_asks_the_kernel_for_their_rows_and_reads_them_back(
        tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch):
    """`VectorStore.gather` prefetches the memory-mapped rows of every item it reads (madvise
    WILLNEED on their pages, the last item's up to the file's end) and returns the same vectors."""
    rng = np.random.default_rng(3)
    dim, sizes = 40, rng.integers(1, 9, 700)
    store = VectorStore(dim, dtype)
    locs = [store.append(rng.standard_normal((int(k), dim)).astype(np.float32)) for k in sizes]
    store.write_live(tmp_path / "seg.npy")
    live = [store.rows(seg, off, int(k)).astype(np.float32) for (seg, off), k in zip(locs, sizes, strict=True)]
    rows = int(sizes.sum())
    store.commit(["seg.npy"], [VectorStore.open_segment(tmp_path / "seg.npy", dim, store.dtype, rows)])
    handle = store.segments[0]._mmap  # type: ignore[attr-defined]
    recorder = MadviseRecorder(handle)
    advised = recorder.calls[mmap.MADV_WILLNEED]

    pick = np.r_[rng.choice(len(sizes) - 1, 60, replace=False), len(sizes) - 1]  # and the file's last item
    seg = np.zeros(len(pick), np.int64)
    off = np.asarray([locs[i][1] for i in pick], np.int64)
    n = sizes[pick].astype(np.int64)
    monkeypatch.setattr(store.segments[0], "_mmap", recorder)
    vecs, mask = store.gather(seg, off, n)
    assert not recorder.calls[mmap.MADV_DONTNEED]
    assert len(advised) == len(pick)
    width = store.cols * store.dtype.itemsize
    header = store.segments[0].offset  # type: ignore[attr-defined]
    for (a, b), o, k in zip(advised, off, n, strict=True):  # each advice covers the item's bytes
        assert a <= header + o * width and header + (o + k) * width <= b
    for row, i in enumerate(pick):
        np.testing.assert_array_equal(vecs[row, : sizes[i]], live[i])
        assert mask[row].sum() == sizes[i]


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_gather_rows_returns_each_items_rows_in_the_given_order_across_segments_and_live_rows(
        tmp_path: Path, dtype: str):
    """`VectorStore.gather_rows` (the unpadded read of the prescore codes) gives, for items in any order
    from two saved segments and the live rows, the rows `rows` reads one item at a time, and
    `dots` their products with queries as the decoded rows' products; `gather` pads the same rows."""
    rng = np.random.default_rng(5)
    dim = 12
    store = VectorStore(dim, dtype)
    locs, sizes = [], []
    for part in range(3):
        for _ in range(40):
            k = int(rng.integers(1, 7))
            locs.append(store.append(rng.standard_normal((k, dim)).astype(np.float32)))
            sizes.append(k)
        if part < 2:
            rows = store.write_live(tmp_path / f"seg{part}.npy")
            store.commit([*store.files, f"seg{part}.npy"], [*store.segments, VectorStore.open_segment(
                tmp_path / f"seg{part}.npy", dim, store.dtype, rows)])
    expected = [store.rows(seg, off, k).astype(np.float32) for (seg, off), k in zip(locs, sizes, strict=True)]
    for pick in (rng.permutation(len(locs))[:70], np.arange(len(locs)), np.asarray([3])):
        seg = np.asarray([locs[i][0] for i in pick], np.int64)
        off = np.asarray([locs[i][1] for i in pick], np.int64)
        n = np.asarray([sizes[i] for i in pick], np.int64)
        raw = store.gather_rows(seg, off, n)
        want = np.concatenate([expected[i] for i in pick])
        np.testing.assert_array_equal(store.decode(raw), want)
        queries = rng.standard_normal((3, dim)).astype(np.float32)
        np.testing.assert_allclose(store.dots(raw, queries), want @ queries.T, rtol=1e-5, atol=1e-5)
        vecs, mask = store.gather(seg, off, n)
        np.testing.assert_array_equal(vecs[mask], want)
        assert (vecs[~mask] == 0).all() and (mask.sum(axis=1) == n).all()
    with pytest.raises(IndexError):
        store.gather_rows(np.zeros(1, np.int64), np.asarray([10_000]), np.asarray([2]))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_run_of_equal_items_is_gathered_as_a_view_of_the_mapped_segment(tmp_path: Path, dtype: str):
    """Items one after another in a saved float32 segment, each with the same number of rows (an exact
    scan in file order), come back as a read-only view of the mapping, equal to the copy `gather` makes
    otherwise; items out of order, of other sizes or of another precision are copied as before."""
    rng = np.random.default_rng(6)
    dim, per = 8, 4
    store = VectorStore(dim, dtype)
    locs = [store.append(rng.standard_normal((per, dim)).astype(np.float32)) for _ in range(10)]
    locs.append(store.append(rng.standard_normal((per - 1, dim)).astype(np.float32)))
    rows = store.write_live(tmp_path / "seg0.npy")
    store.commit(["seg0.npy"], [VectorStore.open_segment(tmp_path / "seg0.npy", dim, store.dtype, rows)])
    expected = [store.rows(seg, off, per if i < 10 else per - 1).astype(np.float32)
                for i, (seg, off) in enumerate(locs)]
    seg = np.asarray([s for s, _ in locs], np.int64)
    off = np.asarray([o for _, o in locs], np.int64)
    n = np.asarray([per] * 10 + [per - 1], np.int64)
    vecs, mask = store.gather(seg[2:7], off[2:7], n[2:7])
    np.testing.assert_array_equal(vecs.reshape(-1, dim), np.concatenate(expected[2:7]))
    viewed = dtype == "float32"
    assert mask.all() and np.shares_memory(vecs, store.segments[0]) == viewed and vecs.flags.writeable != viewed
    for pick in ([4, 2, 3], [8, 9, 10], [1, 3]):  # out of order, an item of other size, a gap
        v, m = store.gather(seg[pick], off[pick], n[pick])
        assert not np.shares_memory(v, store.segments[0])
        np.testing.assert_array_equal(v[m], np.concatenate([expected[i] for i in pick]))


def test_a_merge_writes_through_a_buffer_and_drops_the_rows_it_read_from_its_mapping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`VectorStore.write_items` (the saves' compaction) gives a file with the items' rows one after
    another, and releases (madvise DONTNEED) every mapped page it read as it goes, so merging segments
    of many GB does not keep them in the resident set."""
    rng = np.random.default_rng(7)
    dim = 16
    store = VectorStore(dim, "float16")
    sizes = rng.integers(1, 9, 500)
    locs = [store.append(rng.standard_normal((int(k), dim)).astype(np.float32)) for k in sizes]
    rows = store.write_live(tmp_path / "seg.npy")
    store.commit(["seg.npy"], [VectorStore.open_segment(tmp_path / "seg.npy", dim, store.dtype, rows)])
    recorder = MadviseRecorder(store.segments[0]._mmap)  # type: ignore[attr-defined]
    released = recorder.calls[mmap.MADV_DONTNEED]
    monkeypatch.setattr(store.segments[0], "_mmap", recorder)
    monkeypatch.setattr(fragsearch.index.store, "WRITE_BYTES", 4096)  # many writes
    keep = [(0, off, int(k)) for (_, off), k in zip(locs, sizes, strict=True)][::2]
    offsets = store.write_items(tmp_path / "merged.npy", keep)
    merged = np.load(tmp_path / "merged.npy")
    for (_, off, n), new in zip(keep, offsets, strict=True):
        np.testing.assert_array_equal(merged[new : new + n], store.segments[0][off : off + n])
    assert len(released) > 5
    width = store.cols * 2
    header = store.segments[0].offset  # type: ignore[attr-defined]
    for _, off, n in keep:  # every row read lies in a released range
        assert any(a <= header + off * width and header + (off + n) * width <= b for a, b in released)


def test_deriving_codes_drops_each_encoded_block_and_the_sample_from_the_mappings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`fragsearch.index.codes.derive` reads a store segment through its own map block by block and drops each
    block from the mapping once encoded (every row's bytes lie in a released range), and drops the
    store's maps after drawing the projection's sample; the codes are the encoded projections."""
    from fragsearch.index import codes

    rng = np.random.default_rng(11)
    dim, d = 16, 6
    store = VectorStore(dim, "float16")
    for k in rng.integers(1, 9, 150):
        store.append(rng.standard_normal((int(k), dim)).astype(np.float32))
    rows = store.write_live(tmp_path / "seg.npy")
    store.commit(["seg.npy"], [VectorStore.open_segment(tmp_path / "seg.npy", dim, store.dtype, rows)])
    mapped = MadviseRecorder(store.segments[0]._mmap)  # type: ignore[attr-defined]
    monkeypatch.setattr(store.segments[0], "_mmap", mapped)
    opened: list[MadviseRecorder] = []
    open_segment = VectorStore.open_segment

    def recording_open(path: Path, dim: int, dtype: np.dtype, rows: int, in_memory: bool = False) -> np.ndarray:
        arr = open_segment(path, dim, dtype, rows, in_memory)
        if isinstance(arr, np.memmap):
            opened.append(MadviseRecorder(arr._mmap))  # type: ignore[attr-defined]
            arr._mmap = opened[-1]  # type: ignore[attr-defined]
        return arr

    monkeypatch.setattr(VectorStore, "open_segment", staticmethod(recording_open))
    monkeypatch.setattr(codes, "ENCODE_ROWS", 64)
    created: list[Path] = []
    info = codes.derive(tmp_path, store, ["seg.npy"], [rows], d, None,
                        lambda size: store.decode(np.asarray(store.segments[0][:size])), 1, created)
    assert info is not None and len(opened) == 1
    assert mapped.calls[mmap.MADV_DONTNEED], "the store's maps are kept after the sample"
    released = opened[0].calls[mmap.MADV_DONTNEED]
    assert len(released) == -(-rows // 64)
    width = store.cols * store.dtype.itemsize
    header = store.segments[0].offset  # type: ignore[attr-defined]
    for r in range(rows):
        assert any(a <= header + r * width and header + (r + 1) * width <= b for a, b in released)
    projection = np.load(tmp_path / info.projection)
    expected = VectorStore(d, "int8").encode(store.decode(np.asarray(store.segments[0])) @ projection.T)
    np.testing.assert_array_equal(np.load(tmp_path / info.files[0]), expected)
