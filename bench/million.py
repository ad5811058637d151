"""A large image collection through the product's own write path, in bounded memory.

    python -m bench.million --images 1000000 --work artifacts/bench-1m --model artifacts/models/full-val/model.pt

Build: synthetic images are written as embedded fragment shards (`fragsearch.index.shards.ShardWriter`, the
shard format of `fragsearch.index.bulk`), `--part` images at a time; each part is loaded with
`fragsearch.index.shards.load_shards` (the public load / commit path: streamed adds, the candidate index
trained on a sample of the first group, the re-rank store spilled to disk and committed in groups)
and its shards are removed once committed (`remove_loaded`), so the collection is never twice on disk.

The vectors are realistic, not random: the dev images' cached crop features are embedded by the
model (the real fragments, with their norms); a synthetic image takes a dev image's whole-image
fragment and half of its regions, the other half from other dev images, each fragment moved by
Gaussian noise (`--noise` of the fragments' per-dimension spread) and scaled back to its source's norm.
Queries are the first `--queries` dev captions, encoded by the model as the service encodes them.

Measured: the build's images per second from shards (loading only; the shards' writing is timed
apart) and the process's peak RSS while building (sampled with psutil, anonymous and
file-backed apart; ru_maxrss beside); the index folder's bytes per image; agreement@10 with the
exhaustive exact S_kl and retrieval latency for each search setting; the exhaustive p50 on a few
queries; with `--int8`, the same candidates re-ranked from an int8 copy of their stored vectors
(`fragsearch.index.store`'s int8 encoding), to state the agreement an int8 store keeps at this size. With
`--reads both`, each setting is measured with the store's read-ahead (a gather asks the kernel for
all its rows at once) and without it, side by side; with `--cold`, each setting on the index opened
afresh after dropping the page cache, with no warm-up: the re-rank store read from disk as after a
restart. Rows are
appended to docs/results/index-bench.csv (collection `synthetic-real-<size>-h<h>`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import resource
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import faiss
import numpy as np
import psutil
from tqdm import tqdm

from bench.index_bench import K, Row, agreement, ann_bytes_per_fragment, describe, read_row, timed, write_csv
from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.compaction import merged_rows, smaller_half
from fragsearch.index.images import exact_top_k
from fragsearch.index.shards import ShardWriter, load_shards, shard_settings
from fragsearch.index.store import VectorStore
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.embed import EmbeddedSentence, embed_sentence
from fragsearch.model.onnx import set_threads
from fragsearch.settings import default_artifacts_dir, default_data_dir

logger = logging.getLogger("bench.million")

SHARD_SIZE = 1024  # images per synthetic shard
NOISE_BANK = 1 << 16  # noise rows drawn once and reused at random


def load_average() -> str:
    return f"{os.getloadavg()[0]:.1f}"


class RssSampler:
    """Peak VmRSS / RssAnon / RssFile of this process (MB), sampled every `every` seconds in a thread."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self, every: float = 0.2) -> None:
        self.every = every
        self.peak = dict.fromkeys(self.FIELDS, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> dict[str, float]:
        """Resident MB now: all, anonymous, file-backed (psutil's shared: file pages and shared memory)."""
        mem = psutil.Process().memory_info()
        return {"VmRSS": mem.rss / 2**20, "RssAnon": (mem.rss - mem.shared) / 2**20, "RssFile": mem.shared / 2**20}

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, v in self.now().items():
                self.peak[k] = max(self.peak[k], v)
            self._stop.wait(self.every)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for k, v in self.now().items():
            self.peak[k] = max(self.peak[k], v)

    def describe(self) -> str:
        return ", ".join(f"{k} {v:.0f} MB" for k, v in self.peak.items())


class RealisticImages:
    """Synthetic images around the model's real dev-image fragments (see the module docstring)."""

    def __init__(self, real: np.ndarray, noise: float, seed: int = 0) -> None:
        self.real = real.astype(np.float32)  # (n_images, F, h)
        self.norms = np.linalg.norm(self.real, axis=2)
        rng = np.random.default_rng(seed)
        spread = self.real.reshape(-1, real.shape[2]).std(axis=0)
        self.noise = (noise * rng.standard_normal((NOISE_BANK, real.shape[2])) * spread).astype(np.float32)
        self.seed = seed

    def images(self, start: int, count: int) -> np.ndarray:
        """Images start .. start+count-1 (deterministic): (count, F, h) float32."""
        n_real, n_frag, _ = self.real.shape
        rng = np.random.default_rng((self.seed, start))
        base = rng.integers(0, n_real, count)
        src_img = np.repeat(base[:, None], n_frag, axis=1)
        src_row = np.repeat(np.arange(n_frag)[None, :], count, axis=0)
        swap = rng.random((count, n_frag)) < 0.5
        swap[:, 0] = False  # the whole-image fragment stays the base image's
        src_img[swap] = rng.integers(0, n_real, int(swap.sum()))
        src_row[swap] = rng.integers(1, n_frag, int(swap.sum()))
        out = self.real[src_img, src_row] + self.noise[rng.integers(0, NOISE_BANK, (count, n_frag))]
        out *= (self.norms[src_img, src_row] / np.maximum(np.linalg.norm(out, axis=2), 1e-6))[..., None]
        return out


def real_fragments(bundle: Bundle, data: Path, cache_dir: Path) -> tuple[np.ndarray, list[str]]:
    """The dev images' fragments as the model embeds them (n, F, h), and the dev captions."""
    split = load_split(data, "dev")
    paths = [split.image_path(n) for n in split.images]
    cache = feature_cache(cache_dir, bundle.image_cfg)
    feats = np.stack([f.features for f in cache.load(paths)])
    real = np.concatenate([bundle.embed_images(feats[i : i + 64]) for i in range(0, len(feats), 64)])
    return real, [caps[0] for caps in split.captions]


@contextmanager
def phase(name: str) -> Iterator[RssSampler]:
    logger.info("%s: start (load average %s)", name, load_average())
    t0 = time.perf_counter()
    with RssSampler() as rss:
        yield rss
    logger.info("%s: %.1f s, peak %s (load average %s)", name, time.perf_counter() - t0, rss.describe(),
                load_average())


SETTING_FIELDS = ("nprobe", "k_prime", "rerank", "prescore", "refine", "summaries")


def search_setting(base: IndexSettings, text: str) -> IndexSettings:
    """`base` with the search setting `nprobe:k_prime:rerank[:prescore[:refine[:summaries]]]` (the
    last three 0 when left out), as --sweep and --save-setting write it."""
    parts = text.strip().split(":")
    if not 3 <= len(parts) <= len(SETTING_FIELDS) or not all(p.isdigit() for p in parts):
        raise SystemExit(f"bench.million: a search setting is nprobe:k_prime:rerank[:prescore[:refine[:summaries]]] "
                         f"in whole numbers, not {text!r}")
    values = [int(p) for p in parts] + [0] * (len(SETTING_FIELDS) - len(parts))
    return base.with_search(**dict(zip(SETTING_FIELDS, values, strict=True)))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def build(args: argparse.Namespace, bundle: Bundle, gen: RealisticImages, settings: IndexSettings
          ) -> dict[str, float]:
    """Shards part by part, each loaded and removed; returns the build's measurements."""
    index_dir, shards = args.work / "index", args.work / "shards"
    if not args.resume:
        shutil.rmtree(index_dir, ignore_errors=True)
    for stale in args.work.glob("truth-*.json"):  # the exhaustive truth of the collection being replaced
        stale.unlink()
    shutil.rmtree(shards, ignore_errors=True)
    cfg = shard_settings(bundle.image_cfg)
    boxes = np.tile(np.array([0, 0, 224, 224], np.float32), (gen.real.shape[1], 1))
    write_s = load_s = 0.0
    peak_disk = 0
    faiss.omp_set_num_threads(args.build_threads)
    with phase("build") as rss:
        index = ImageIndex.load(index_dir, bundle) if args.resume else ImageIndex.create(index_dir, bundle, settings)
        first = len(index)  # images committed by an earlier, stopped build (--resume)
        for start in tqdm(range(first, args.images, args.part), desc="parts", unit="part"):
            count = min(args.part, args.images - start)
            t0 = time.perf_counter()
            with ShardWriter(shards, cfg, SHARD_SIZE, embedded_by=index.fingerprint, dim=bundle.dim) as writer:
                for s0 in range(start, start + count, SHARD_SIZE):
                    vecs = gen.images(s0, min(SHARD_SIZE, start + count - s0))
                    for i, v in enumerate(vecs):
                        name = f"syn{s0 + i:08d}.jpg"
                        writer.add_vectors(name, name, f"/synthetic/{name}", v, boxes, 224, 224)
            write_s += time.perf_counter() - t0
            peak_disk = max(peak_disk, folder_bytes(shards) + folder_bytes(index_dir))
            t0 = time.perf_counter()
            load_shards(index, shards, progress=False, commit_images=args.commit_images, remove_loaded=True)
            load_s += time.perf_counter() - t0
            logger.info("%d images loaded; RSS now %s; load average %s", len(index), RssSampler.now(), load_average())
        index.close()
    disk = folder_bytes(index_dir)
    shutil.rmtree(shards, ignore_errors=True)
    out = {"write_s": write_s, "load_s": load_s, "images_per_s": (args.images - first) / load_s, "disk": disk,
           "resumed_at": first,
           "peak_disk": peak_disk, "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           **{f"peak_{k}_mb": v for k, v in rss.peak.items()}}
    logger.info("build: %s", json.dumps({k: round(v, 1) for k, v in out.items()}))
    return out


def int8_agreement(index: ImageIndex, queries: list[np.ndarray], truth: list[list[int]]) -> float:
    """agreement@10 of the indexed search when the candidates' stored vectors are read back through
    an int8 store's encoding (the same candidates: the candidate stage does not read the store)."""
    int8 = VectorStore(index.dim, "int8")
    found = []
    for q in queries:
        with index.reading():
            cand = index.ranker.candidates(q)
            vecs, mask = index.store.gather(index.items.seg[cand], index.items.off[cand], index.items.n[cand])
        flat = vecs.reshape(-1, index.dim)
        vecs = int8.decode(int8.encode(flat)).reshape(vecs.shape)
        scores = index.bundle.scores(vecs, mask.astype(np.float32), q[None], np.ones((1, len(q)), np.float32))[:, 0]
        order = np.lexsort((cand, -scores))[:K]
        found.append(cand[order].tolist())
    return agreement(found, truth)


def add_codes(args: argparse.Namespace, index: ImageIndex, built: dict[str, float]) -> None:
    """Give the index `--codes`-dimensional prescore codes (the save's derivation over every stored
    segment, index.codes), timed; the folder's size after it becomes the build's `disk`."""
    faiss.omp_set_num_threads(args.build_threads)
    set_threads(args.build_threads)
    with phase(f"add {args.codes}-d prescore codes" + f" and {args.refine_codes}-d refining codes" * bool(
            args.refine_codes)) as rss:
        t0 = time.perf_counter()
        index.add_codes(args.codes, args.refine_codes)
        seconds = time.perf_counter() - t0
    built.update(codes_s=seconds, **{f"codes_peak_{k}_mb": v for k, v in rss.peak.items()},
                 disk=folder_bytes(args.work / "index"), peak_VmRSS_mb=max(built["peak_VmRSS_mb"], rss.peak["VmRSS"]))
    (args.work / "build.json").write_text(json.dumps(built))
    logger.info("codes added in %.0f s (%.0f fragments/s); folder %.0f B/image", seconds,
                index.n_fragments / seconds, built["disk"] / len(index))


def merge_probe(args: argparse.Namespace, bundle: Bundle, built: dict[str, float]) -> None:
    """The compaction's write at this size: the live rows of the smaller half of the store's segments
    (what a save merges when they pass index.compaction.MAX_SEGMENTS) written one after another through
    `VectorStore.write_items` into a scratch file beside the index (removed after), timed, with the
    process's peak RSS; into build.json as merge_*."""
    index = ImageIndex.load(args.work / "index", bundle)
    store, items = index.store, index.items
    rows = [len(s) for s in store.segments]
    merge = smaller_half(rows)
    live = items.live()
    _, locs = merged_rows(live[np.isin(items.seg[live], merge)], items.seg, items.off, items.n)
    scratch = args.work / "merge-probe.npy"
    with phase(f"merge {len(merge)} of {len(rows)} store segments ({sum(n for _, _, n in locs)} rows)") as rss:
        t0 = time.perf_counter()
        store.write_items(scratch, locs)
        seconds = time.perf_counter() - t0
    merged = scratch.stat().st_size
    scratch.unlink()
    index.close()
    built.update(merge_s=seconds, merge_bytes=merged, **{f"merge_peak_{k}_mb": v for k, v in rss.peak.items()})
    (args.work / "build.json").write_text(json.dumps(built))
    logger.info("merged %.1f GB in %.0f s", merged / 1e9, seconds)


def ground_truth(args: argparse.Namespace, index: ImageIndex, queries: list[np.ndarray]
                 ) -> tuple[list[list[int]], np.ndarray]:
    """The exhaustive exact top K of every query (one pass over the store) and the exhaustive search's
    milliseconds on a few queries; kept in --work (truth-<queries>.json) for later runs on the index."""
    cached = args.work / f"truth-{len(queries)}.json"
    if cached.is_file():
        data = json.loads(cached.read_text())
        if data["images"] == len(index) and data.get("fingerprint") == index.fingerprint:
            return data["truth"], np.asarray(data["exhaustive_ms"])
    with phase("exhaustive ground truth") as rss:
        set_threads(args.build_threads)  # the one pass over the store for every query: not timed
        truth = [[i for i, _ in r] for r in exact_top_k(index, queries, K)]
        set_threads(args.threads)
        _, exhaustive_ms = timed(
            lambda q: [h.image_id for h in index.search(EmbeddedSentence(queries[q]), K,
                                                        exhaustive=True).hits], args.exhaustive_timed)
    logger.info("exhaustive p50 %.0f ms over %d queries (peak %s)", np.median(exhaustive_ms), len(exhaustive_ms),
                rss.describe())
    cached.write_text(json.dumps({"images": len(index), "fingerprint": index.fingerprint, "truth": truth,
                                  "exhaustive_ms": exhaustive_ms.tolist()}))
    return truth, exhaustive_ms


def measure(args: argparse.Namespace, bundle: Bundle, captions: list[str], settings: list[IndexSettings],
            built: dict[str, float], command: str) -> list[Row]:
    index = ImageIndex.load(args.work / "index", bundle)
    if args.recode and index.settings.shape.codes:
        index.add_codes(0)  # dropped, so that they are derived anew below
    if args.codes and (index.settings.shape.codes, index.settings.shape.refine_codes) != (args.codes,
                                                                                          args.refine_codes):
        add_codes(args, index, built)
    faiss.omp_set_num_threads(args.threads)
    set_threads(args.threads)
    queries = []
    for text in captions:
        try:
            queries.append(embed_sentence(bundle, text)[0])
        except ValueError:
            continue
        if len(queries) == args.queries:
            break
    label = f"synthetic-real-{args.images // 1000}k-h{bundle.dim}" if args.images < 1_000_000 else \
        f"synthetic-real-{args.images // 1_000_000}M-h{bundle.dim}"
    label += f"-{args.label}" if args.label else ""
    truth, exhaustive_ms = ground_truth(args, index, queries)
    rows = []
    reads = [True, False] if args.reads == "both" else [args.reads == "prefetch"]
    for s, read_ahead in ((s, r) for s in settings for r in reads):
        if args.cold:  # as after a restart: the store's pages neither mapped by this process nor cached
            index.close()
            del index  # its memory maps go with it: pages still mapped are not dropped
            gc.collect()
            drop_page_cache()
            index = ImageIndex.load(args.work / "index", bundle)
        index.set_search(**{k: getattr(s.search, k) for k in SETTING_FIELDS}, exact_below=0)  # summaries computed here
        index.store.read_ahead = read_ahead
        before = load_average()
        with RssSampler() as rss:
            if not args.cold:
                timed(partial(top_ids, index, queries), min(5, len(queries)))  # warm
            found, ms = timed(partial(top_ids, index, queries), len(queries))
        p50, ex50 = float(np.percentile(ms, 50)), float(np.percentile(exhaustive_ms, 50))
        params = describe(index) + (";reads=" + ("prefetch" if read_ahead else "one-by-one")) * (args.reads == "both")
        params += ";cold" * args.cold + f";threads={args.threads}" * (args.threads != 1)
        if os.environ.get("OMP_WAIT_POLICY"):  # recorded: it may change the timings (the service leaves it unset)
            params += f";OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
        row = Row(label, len(index), "faiss", index.candidates.active_kind, params,
                  round(agreement(found, truth), 4), round(p50, 2), round(float(np.percentile(ms, 99)), 2),
                  round(ex50, 1), round(ex50 / p50, 1), round(ann_bytes_per_fragment(index), 1), command,
                  round(max(built["peak_VmRSS_mb"], rss.peak["VmRSS"])), round(built["disk"] / args.images),
                  round(built["images_per_s"], 1), f"{before}/{load_average()}")
        logger.info("%s agree@10 %.3f p50 %.1f ms p99 %.1f ms (x%.0f) measuring RSS %s", row.params,
                    row.agreement_at_10, row.p50_ms, row.p99_ms, row.speedup, rss.describe())
        rows.append(row)
        if args.int8:
            before = load_average()
            a8 = int8_agreement(index, queries, truth)
            rows.append(dataclasses.replace(row, params=row.params.replace(
                f"store={index.settings.shape.store_dtype}-mmap({index.store.bytes_per_row}B/frag)",
                f"store=int8 re-read of these candidates({index.dim + 4}B/frag)"), agreement_at_10=round(a8, 4),
                p50_ms="", p99_ms="", speedup="", load_avg=f"{before}/{load_average()}"))  # type: ignore[arg-type]
            logger.info("  int8 re-read of the same candidates: agree@10 %.3f", a8)
    index.close()
    return rows


def top_ids(index: ImageIndex, queries: list[np.ndarray], q: int) -> list[int]:
    """The ids of the top K images for query q (what a measured search returns)."""
    return [h.image_id for h in index.search(EmbeddedSentence(queries[q]), K).hits]


def drop_page_cache() -> None:
    """Empty the kernel's page cache (root only): the store is read from disk as after a restart."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    art = default_artifacts_dir()
    ap.add_argument("--images", type=int, default=1_000_000, help="images in the made collection")
    ap.add_argument("--part", type=int, default=100_000, help="images written as shards, then loaded, at a time")
    ap.add_argument("--commit-images", type=int, default=100_000, help="load_shards: images between two commits")
    ap.add_argument("--work", type=Path, default=art / "bench-1m",
                    help="index and shards (large; removed unless --keep)")
    ap.add_argument("--model", type=Path, default=art / "models" / "full-val" / "model.pt",
                    help="the model whose fragments the collection is made of")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=art / "cache", help="the feature and parse cache")
    ap.add_argument("--noise", type=float, default=0.5, help="noise as a share of the per-dimension spread")
    ap.add_argument("--nlist", type=int, default=1024, help="the IVF index's lists")
    ap.add_argument("--store-dtype", default="float16", help="the stored fragments' number type")
    ap.add_argument("--sweep", default="16:16384:1024,16:16384:2048,16:32768:2048,32:32768:2048,16:65536:2048",
                    help="search settings measured, nprobe:k_prime:rerank[:prescore[:refine[:summaries]]] "
                         "comma-separated")
    ap.add_argument("--save-setting", default="",
                    help="nprobe:k_prime:rerank[:prescore[:refine[:summaries]]] saved into the kept index after "
                         "measuring (what the service then searches with)")
    ap.add_argument("--codes", type=int, default=0,
                    help="prescore codes of this dimension (index.codes), added to the index before measuring")
    ap.add_argument("--refine-codes", type=int, default=0,
                    help="with --codes: refining codes of this dimension (index.codes), added with them")
    ap.add_argument("--recode", action="store_true",
                    help="with --codes: drop the index's prescore codes first, so that their derivation is measured "
                         "again (its time and peak RSS go into build.json)")
    ap.add_argument("--merge-probe", action="store_true",
                    help="with --skip-build: time the compaction's write of the smaller half of the store's segments "
                         "(into a scratch file, removed after) with its peak RSS, then stop")
    ap.add_argument("--queries", type=int, default=50, help="dev captions asked of each setting")
    ap.add_argument("--exhaustive-timed", type=int, default=3,
                    help="queries of the exact scan over every image that are timed (the reference)")
    ap.add_argument("--threads", type=int, default=1, help="the model's and FAISS threads while measuring")
    ap.add_argument("--build-threads", type=int, default=2, help="threads while building the index")
    ap.add_argument("--reads", choices=("prefetch", "one-by-one", "both"), default="prefetch",
                    help="the store's gathers ask the kernel for all their rows at once (VectorStore.prefetch), "
                         "read them one page fault after another, or each setting measured both ways")
    ap.add_argument("--cold", action="store_true",
                    help="each setting on the index opened afresh after dropping the page cache (root), with no "
                         "warm-up: the store read from disk as after a restart")
    ap.add_argument("--int8", action="store_true", help="also the int8 re-read of each setting's candidates")
    ap.add_argument("--skip-build", action="store_true", help="measure the index already in --work")
    ap.add_argument("--resume", action="store_true", help="continue a stopped build of the index in --work "
                    "(from the images its last commit holds)")
    ap.add_argument("--keep", action="store_true", help="keep the index (for the serving measurements)")
    ap.add_argument("--build-only", action="store_true", help="build the index and write build.json, measure nothing")
    ap.add_argument("--out", type=Path, default=Path("docs/results/index-bench.csv"), help="the results CSV")
    ap.add_argument("--label", default="", help="appended to the rows' collection name: tells two builds of "
                    "the same size apart (a setting measured again on the same collection replaces its row)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = "python -m bench.million " + shlex.join(sys.argv[1:] if argv is None else argv)
    set_threads(args.threads)
    bundle = Bundle.load(args.model)
    real, captions = real_fragments(bundle, args.data, args.cache)
    base = IndexSettings.of(kind="ivfpq", nlist=args.nlist, m=32, pretransform="PCA128", store_dtype=args.store_dtype)
    settings = [search_setting(base, s) for s in args.sweep.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    built_file = args.work / "build.json"
    if args.skip_build:  # the build's measurements as a build run wrote them (build.json)
        built = json.loads(built_file.read_text())
        if args.merge_probe:
            merge_probe(args, bundle, built)
            return
    else:
        built = build(args, bundle, RealisticImages(real, args.noise), base)
        built_file.write_text(json.dumps(built))
        if args.build_only:
            return
    rows = measure(args, bundle, captions, settings, built, command)
    if args.save_setting:
        saved = search_setting(base, args.save_setting)
        index = ImageIndex.load(args.work / "index", bundle)
        index.set_search(**{k: getattr(saved.search, k) for k in SETTING_FIELDS}, exact_below=0)
        index.save()
        index.close()
    old = []
    if args.out.is_file():
        import csv

        with open(args.out, newline="") as f:
            old = [read_row(r) for r in csv.DictReader(f)]
    mine = {(r.collection, r.params) for r in rows}  # a setting measured again replaces its row
    write_csv([r for r in old if (r.collection, r.params) not in mine] + rows, args.out)
    logger.info("wrote %d rows to %s", len(rows), args.out)
    if not args.keep:
        shutil.rmtree(args.work / "index", ignore_errors=True)


if __name__ == "__main__":
    main()
