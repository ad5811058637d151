"""Benchmark of the fragment index: agreement with the exhaustive exact-S_kl ranking, and latency.

    python -m bench.index_bench                                   # dev images + synthetic 10k and 100k
    python -m bench.index_bench --skip-dev --sizes 10000          # synthetic only
    python -m bench.index_bench --sizes --skip-annotate --backends faiss milvus --append   # dev, both backends
    python -m bench.index_bench --sizes --skip-annotate --append --model M/model.pt --label NAME  # another model
    python -m bench.index_bench --sizes --annotate-only --append  # the image -> sentence rows alone

For each collection and index setting, a fixed query set is run through the indexed search (FAISS
candidates, exact re-rank) and through the exhaustive exact ranking of the whole collection;
agreement_at_10 = |indexed top 10 ∩ exhaustive top 10| / 10, averaged over queries; speedup =
exhaustive p50 / indexed p50, measured in the same run. Times are retrieval only (the query's
parse and embedding, the same for both, are left out) on `--threads` threads.

Collections: the Flickr8K dev images with the trained model (when its checkpoint is there; also the
image -> sentence direction over the training captions), and synthetic collections of N images x 20
fragments in the model's h (1000 by default): a topic mixture of intrinsic rank 64 plus isotropic
noise, queries of 6-12 non-negative fragments drawn from 2-3 topics.

`--backends faiss milvus` measures the dev images on both candidate backends side by side in one
run (collection `flickr8k-dev-backends`): in-process FAISS and Milvus (milvus-lite in the work
folder; the same exact re-rank after either).

Writes docs/results/index-bench.csv and index-bench.png (agreement vs latency).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from fragsearch.index import ImageIndex, IndexSettings, SentenceIndex
from fragsearch.index.ann import FaissCandidates
from fragsearch.index.images import embedded_images, exact_top_k
from fragsearch.index.types import BACKENDS, BackendOptions
from fragsearch.model.bundle import Bundle
from fragsearch.model.cache import FeatureCache
from fragsearch.model.config import ImageConfig, TextConfig
from fragsearch.model.data import Split, load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.embed import EmbeddedSentence, embed_sentence
from fragsearch.model.encoders import Encoders, ModelConfig
from fragsearch.model.fragments import WORD_REL, TextPipeline, parse_cached
from fragsearch.model.modelfile import model_file
from fragsearch.model.onnx import set_threads
from fragsearch.model.text import RelationVocab
from fragsearch.model.words import WordTable
from fragsearch.settings import (
    default_artifacts_dir,
    default_cache_dir,
    default_data_dir,
    default_model_path,
)

logger = logging.getLogger("bench.index_bench")

COLUMNS = ["collection", "images", "backend", "index_type", "params", "agreement_at_10", "p50_ms", "p99_ms",
           "exhaustive_p50_ms", "speedup", "bytes_per_fragment", "command", "peak_rss_mb", "disk_bytes_per_image",
           "build_images_per_s", "load_avg"]  # the last four: filled by bench.million (blank in the other rows)
K = 10
N_FRAGMENTS = 20  # paper: the whole image + 19 regions


@dataclass
class Row:
    collection: str
    images: int
    backend: str
    index_type: str
    params: str
    agreement_at_10: float
    p50_ms: float
    p99_ms: float
    exhaustive_p50_ms: float
    speedup: float
    bytes_per_fragment: float
    command: str
    peak_rss_mb: float | str = ""  # the process's peak resident set (build, or measuring; see bench.million)
    disk_bytes_per_image: float | str = ""  # the index folder's bytes per image
    build_images_per_s: float | str = ""  # images loaded per second from shards
    load_avg: str = ""  # 1-minute load average before / after the row's measurement


# -- measuring -------------------------------------------------------------------------------------------
def agreement(found: Sequence[Sequence[int]], truth: Sequence[Sequence[int]], k: int = K) -> float:
    """Mean |found top k ∩ exact top k| / min(k, |exact|)."""
    return float(np.mean([len(set(f[:k]) & set(t[:k])) / max(1, min(k, len(t)))
                          for f, t in zip(found, truth, strict=True)]))


def timed(fn: Callable[[int], list[int]], n: int) -> tuple[list[list[int]], np.ndarray]:
    """Run fn(q) for q < n: results and per-query milliseconds."""
    out, ms = [], []
    for q in range(n):
        t0 = time.perf_counter()
        out.append(fn(q))
        ms.append(1000 * (time.perf_counter() - t0))
    return out, np.asarray(ms)


def ann_bytes_per_fragment(index: ImageIndex | SentenceIndex) -> float:
    """Bytes of the FAISS index (codes, ids, quantiser: what stays in RAM) per fragment; for Milvus,
    the row it stores (float32 vector + fragment id + item id; its index structures come on top)."""
    candidates = index.candidates
    if isinstance(candidates, FaissCandidates):
        return float(faiss.serialize_index(candidates.index).nbytes / max(1, candidates.ntotal))
    return float(4 * index.dim + 16)


def describe(index: ImageIndex | SentenceIndex) -> str:
    store = f"store={index.settings.shape.store_dtype}-mmap({index.store.bytes_per_row}B/frag)"
    text = index.settings.describe().replace(f"store={index.settings.shape.store_dtype}", store)
    if index.codes is not None:
        text = text.replace(f"codes={index.codes.dim}", f"codes={index.codes.dim}-int8({index.codes.dim + 4}B/frag)")
    return text


def row(collection: str, n_items: int, index: ImageIndex | SentenceIndex, found: list[list[int]],
        truth: list[list[int]], ms: np.ndarray, exhaustive_ms: np.ndarray, command: str) -> Row:
    p50, ex50 = float(np.percentile(ms, 50)), float(np.percentile(exhaustive_ms, 50))
    r = Row(collection, n_items, index.candidates.NAME, index.candidates.active_kind, describe(index),
            round(agreement(found, truth), 4),
            round(p50, 2), round(float(np.percentile(ms, 99)), 2), round(ex50, 2), round(ex50 / p50, 1),
            round(ann_bytes_per_fragment(index), 1), command)
    logger.info("%-28s %-6s %-6s %-70s agree@10 %.3f  p50 %7.2f ms  p99 %7.2f ms  exh %8.1f ms  x%.1f  %.0f B/frag",
                collection, r.backend, r.index_type, r.params, r.agreement_at_10, r.p50_ms, r.p99_ms,
                r.exhaustive_p50_ms, r.speedup, r.bytes_per_fragment)
    return r


def sweep(index: ImageIndex | SentenceIndex, settings: Sequence[IndexSettings],
          measure: Callable[[], Row], build_threads: int) -> list[Row]:
    """Measure every setting with the candidate stage on (exact_below=0: collections under the
    default limit would otherwise be scanned exactly, and every row would measure the scan); the
    candidate index is rebuilt (on `build_threads`) only when its structure changes."""
    rows = []
    for s in settings:
        now = index.settings.search
        structural = s.with_search(nprobe=now.nprobe, ef_search=now.ef_search, k_prime=now.k_prime, rerank=now.rerank,
                                   use_gpu=False)
        current = index.settings.with_search(use_gpu=False)
        if structural != current or not index.candidates.trained:
            t0 = time.perf_counter()
            search_threads = faiss.omp_get_max_threads()
            faiss.omp_set_num_threads(build_threads)
            index.rebuild(s)
            faiss.omp_set_num_threads(search_threads)
            logger.info("built %s in %.1f s", s.shape.factory(), time.perf_counter() - t0)
        index.set_search(nprobe=s.search.nprobe, ef_search=s.search.ef_search, k_prime=s.search.k_prime,
                         rerank=s.search.rerank, exact_below=0)
        rows.append(measure())
    return rows


# -- the dev images ----------------------------------------------------------------------------------------
def dev_queries(bundle: Bundle, split: Split, n: int) -> list[np.ndarray]:
    """The fragments of the first caption of each of the first n dev images (captions without one left out)."""
    queries = []
    for caps in split.captions[:n]:
        try:
            queries.append(embed_sentence(bundle, caps[0])[0])
        except ValueError:
            continue
    return queries


def dev_fragments(args: argparse.Namespace, bundle: Bundle) -> tuple[Split, list[Path], FeatureCache, list]:
    """The dev split, its images' paths, the feature cache and their fragments (extracted where missing)."""
    split = load_split(args.data, "dev")
    paths = [split.image_path(n) for n in split.images]
    cache = feature_cache(args.cache, bundle.image_cfg)
    cache.ensure(paths, workers=args.workers)
    return split, paths, cache, cache.load(paths)


def dev_rows(args: argparse.Namespace, bundle: Bundle, command: str) -> list[Row]:
    split, paths, cache, frags = dev_fragments(args, bundle)
    work = args.workdir / "dev-images"
    shutil.rmtree(work, ignore_errors=True)
    index = ImageIndex.create(work, bundle, IndexSettings(), cache=cache)
    index.add(frags, list(split.images), paths)
    index.save()
    queries = dev_queries(bundle, split, args.dev_queries)
    logger.info("dev: %d images, %d queries, %.1f fragments per query on average", len(index), len(queries),
                np.mean([len(q) for q in queries]))
    truth = [[i for i, _ in r] for r in exact_top_k(index, queries, K)]
    _, exhaustive_ms = timed(
        lambda q: [h.image_id for h in index.search(EmbeddedSentence(queries[q]), K, exhaustive=True).hits], min(200,
                                                                                                                 len(queries)))
    nlist = 128
    base = IndexSettings()  # the defaults: flat, k_prime 128
    settings = [base.with_search(k_prime=kp) for kp in (16, 32, 64, 128, 256)]
    settings += [IndexSettings.of(kind="hnsw", ef_search=ef) for ef in (32, 128)]
    settings += [IndexSettings.of(kind="ivf", nlist=nlist, nprobe=p) for p in (4, 16)]
    settings += [IndexSettings.of(kind="ivfpq", nlist=nlist, pretransform="PCA128", nprobe=16, k_prime=kp, rerank=r)
                 for kp, r in ((128, 0), (512, 0), (512, 128))]

    def measure() -> Row:
        found, ms = timed(lambda q: [h.image_id for h in index.search(EmbeddedSentence(queries[q]), K).hits],
                          len(queries))
        return row("flickr8k-dev" + (f" ({args.label})" if args.label else ""), len(index), index, found, truth, ms,
                   exhaustive_ms, command)

    rows = sweep(index, settings, measure, args.build_threads)
    index.close()
    if not args.skip_annotate:
        rows += annotate_rows(args, bundle, frags, command)
    return rows


def backend_rows(args: argparse.Namespace, bundle: Bundle, command: str) -> list[Row]:
    """The dev images on each of `args.backends`, side by side: the same queries, the same exact
    ground truth, settings that exist on both (the candidate stage always on: exact_below=0)."""
    split = load_split(args.data, "dev")
    paths = [split.image_path(n) for n in split.images]
    cache = feature_cache(args.cache, bundle.image_cfg)
    cache.ensure(paths, workers=args.workers)
    frags = cache.load(paths)
    queries = dev_queries(bundle, split, args.dev_queries)
    base = IndexSettings.of(exact_below=0)
    settings = [base, base.with_shape(kind="hnsw").with_search(ef_search=128),
                base.with_shape(kind="ivf", nlist=128).with_search(nprobe=16)]
    rows: list[Row] = []
    truth: list[list[int]] = []
    for name in args.backends:
        work = args.workdir / f"dev-images-{name}"
        shutil.rmtree(work, ignore_errors=True)
        index = ImageIndex.create(work, bundle, base, cache=cache, backend=BackendOptions(name))
        index.add(frags, list(split.images), paths)
        index.save()
        truth = truth or [[i for i, _ in r] for r in exact_top_k(index, queries, K)]
        logger.info("dev on %s: %d images, %d queries", name, len(index), len(queries))
        rows += sweep(index, settings, BackendMeasure(index, queries, truth, command), args.build_threads)
        index.close()
    return rows


class BackendMeasure:
    """One row of `backend_rows`: the indexed search of every query against the exact truth, with the
    exhaustive search of (up to) 200 queries on the same index as the reference time."""

    def __init__(self, index: ImageIndex, queries: list[np.ndarray], truth: list[list[int]], command: str) -> None:
        self.index, self.queries, self.truth, self.command = index, queries, truth, command
        _, self.exhaustive_ms = timed(self._exhaustive, min(200, len(queries)))

    def _exhaustive(self, q: int) -> list[int]:
        return [h.image_id for h in self.index.search(EmbeddedSentence(self.queries[q]), K, exhaustive=True).hits]

    def _indexed(self, q: int) -> list[int]:
        return [h.image_id for h in self.index.search(EmbeddedSentence(self.queries[q]), K).hits]

    def __call__(self) -> Row:
        found, ms = timed(self._indexed, len(self.queries))
        return row("flickr8k-dev-backends", len(self.index), self.index, found, self.truth, ms, self.exhaustive_ms,
                   self.command)


def annotate_rows(args: argparse.Namespace, bundle: Bundle, frags: list, command: str) -> list[Row]:
    """Image -> sentence over the training captions, queried with dev images."""
    split = load_split(args.data, "train")
    sentences, _ = split.sentences()
    work = args.workdir / "train-sentences"
    shutil.rmtree(work, ignore_errors=True)
    index = SentenceIndex.create(work, bundle)
    parsed = parse_cached(bundle.text.parser, sentences, args.cache / "parses")
    with index.bulk():
        index.add(sentences, parsed)
    index.save()
    queries = frags[: args.annotate_queries]
    truth, exhaustive_ms = timed(
        lambda q: [h.sentence_id for h in index.annotate(queries[q], K, exhaustive=True).hits], len(queries))
    settings = [IndexSettings.of(k_prime=kp, rerank=r) for kp, r in ((16, 0), (128, 0), (0, 30), (0, 100))]
    settings += [IndexSettings.of(kind="ivfpq", nlist=512, pretransform="PCA128", nprobe=16, k_prime=0, rerank=100)]
    settings += [IndexSettings.of(kind="ivf", nlist=1024, nprobe=p, k_prime=0, rerank=100) for p in (32, 128)]

    def measure() -> Row:
        found, ms = timed(lambda q: [h.sentence_id for h in index.annotate(queries[q], K).hits], len(queries))
        return row("flickr8k-train-captions (annotate)", len(index), index, found, truth, ms, exhaustive_ms, command)

    rows = sweep(index, settings, measure, args.build_threads)
    index.close()
    return rows


# -- synthetic collections ---------------------------------------------------------------------------------
class Synthetic:
    """Images as topic mixtures in a rank-`rank` subspace of R^h plus isotropic noise.

    Each image draws 3 of `topics` topics; its whole-image fragment is their mean, each region one
    of them (plus latent noise). Queries mix 2-3 topics into 6-12 non-negative fragments.
    """

    def __init__(self, h: int, seed: int = 0, rank: int = 64, topics: int = 1000, bank: int = 1 << 15) -> None:
        rng = np.random.default_rng(seed)
        self.h, self.seed, self.topics = h, seed, topics
        self.lift = (rng.standard_normal((rank, h)) / np.sqrt(rank)).astype(np.float32)
        self.bias = (0.5 * rng.standard_normal(h)).astype(np.float32)
        self.centres = rng.standard_normal((topics, rank)).astype(np.float32)
        self.noise = (0.5 * rng.standard_normal((bank, h))).astype(np.float32)  # rows reused at random

    def images(self, start: int, count: int) -> np.ndarray:
        """Images start .. start+count-1 (deterministic): (count, 20, h) float32."""
        rng = np.random.default_rng((self.seed, start))
        topics = rng.integers(0, self.topics, (count, 3))
        region_topic = np.take_along_axis(topics, rng.integers(0, 3, (count, N_FRAGMENTS - 1)), axis=1)
        z = np.empty((count, N_FRAGMENTS, self.centres.shape[1]), np.float32)
        z[:, 0] = self.centres[topics].mean(1) + 0.3 * rng.standard_normal((count, z.shape[2]))
        z[:, 1:] = self.centres[region_topic] + 0.6 * rng.standard_normal((count, N_FRAGMENTS - 1, z.shape[2]))
        out = z.reshape(-1, z.shape[2]).astype(np.float32) @ self.lift.astype(np.float32)
        out = out.reshape(count, N_FRAGMENTS, self.h) + self.bias
        out += self.noise[rng.integers(0, len(self.noise), (count, N_FRAGMENTS))]
        return out

    def queries(self, n: int) -> list[np.ndarray]:
        rng = np.random.default_rng((self.seed, 1 << 40))
        out = []
        for _ in range(n):
            topics = rng.integers(0, self.topics, rng.integers(2, 4))
            t = int(rng.integers(6, 13))
            z = self.centres[rng.choice(topics, t)] + 0.6 * rng.standard_normal((t, self.centres.shape[1]))
            lifted = z.astype(np.float32) @ self.lift.astype(np.float32)
            s = np.maximum(lifted + 0.3 * rng.standard_normal((t, self.h)), 0) / np.sqrt(self.h)
            out.append(s.astype(np.float32))
        return out


def scoring_bundle(h: int) -> Bundle:
    """A bundle whose only use is its score (S_kl of a fragment model) for synthetic vectors."""
    words = WordTable(["<none>"], np.zeros((1, 384), np.float32))
    text = TextPipeline(TextConfig(), RelationVocab([WORD_REL]), words)
    cfg = ModelConfig(h=h, n_relations=1)
    rng = np.random.default_rng(0)  # the weights are unused, but fix the fingerprint
    weights = {"image.weight": rng.standard_normal((h, cfg.img_dim)), "image.bias": np.zeros(h),
               "w_rel.0": rng.standard_normal((2 * cfg.word_dim, h)), "b_rel.0": np.zeros(h)}
    return Bundle(Encoders(cfg, weights), text, ImageConfig(), weights={})


def synthetic_rows(args: argparse.Namespace, n_images: int, h: int, command: str) -> list[Row]:
    gen = Synthetic(h)
    bundle = scoring_bundle(h)
    work = args.workdir / f"synthetic-{n_images}"
    shutil.rmtree(work, ignore_errors=True)
    big = n_images >= 50_000
    nlist = int(256 * 2 ** round(2 * np.log10(max(1.0, n_images / 10_000))))  # 10k: 256, 100k: 1024, 1M: 4096
    pq = IndexSettings.of(kind="ivfpq", nlist=nlist, m=32, pretransform="PCA128", store_dtype="float16")
    index = ImageIndex.create(work, bundle, pq if big else IndexSettings.of(store_dtype="float16"))
    t0 = time.perf_counter()
    chunk = 2048
    boxes = np.tile(np.array([0, 0, 224, 224], np.float32), (chunk, N_FRAGMENTS, 1))
    with index.bulk():
        for start in tqdm(range(0, n_images, chunk), desc=f"synthetic {n_images}", unit="chunk"):
            count = min(chunk, n_images - start)
            names = [f"syn{start + i:07d}" for i in range(count)]
            index.add(embedded_images(gen.images(start, count), boxes[:count], np.full((count, 2), 224)), names, names,
                      read_places=False)
    index.save()
    logger.info("synthetic %d: stored and indexed in %.1f s", n_images, time.perf_counter() - t0)
    queries = gen.queries(args.queries)
    t0 = time.perf_counter()
    truth = [[i for i, _ in r] for r in exact_top_k(index, queries, K)]
    logger.info("exhaustive ground truth for %d queries in one pass: %.1f s", len(queries), time.perf_counter() - t0)
    n_timed = min(len(queries), args.exhaustive_timed if big else 20, 3 if n_images >= 1_000_000 else 1000)
    _, exhaustive_ms = timed(
        lambda q: [h.image_id for h in index.search(EmbeddedSentence(queries[q]), K, exhaustive=True).hits], n_timed)
    settings = [pq.with_search(nprobe=p, k_prime=kp, rerank=r)
                for p, kp, r in ((16, 64, 0), (64, 64, 0), (16, 256, 0), (16, 1024, 256), (16, 1024, 1024),
                                 (16, 4096, 512))]
    if n_images >= 1_000_000:  # candidates in proportion to the collection
        settings += [pq.with_search(nprobe=16, k_prime=kp, rerank=r)
                     for kp, r in ((16384, 1024), (16384, 2048), (32768, 2048), (16384, 4096), (65536, 2048))]
    if not big:  # raw-vector kinds keep h * 4 bytes per fragment in RAM: measured on the small collection
        settings = [IndexSettings.of(kind="flat", k_prime=kp, store_dtype="float16") for kp in (64, 256)] + settings
        settings += [IndexSettings.of(kind="hnsw", pretransform="PCA128", ef_search=128, k_prime=64,
                                   store_dtype="float16"),
                     IndexSettings.of(kind="ivf", nlist=256, nprobe=16, k_prime=64, store_dtype="float16")]

    size = f"{n_images // 1000}k" if n_images < 1_000_000 else f"{n_images // 1_000_000}M"
    label = f"synthetic-{size}-h{h}"

    def measure() -> Row:
        found, ms = timed(lambda q: [hit.image_id for hit in index.search(EmbeddedSentence(queries[q]), K).hits],
                          len(queries))
        return row(label, n_images, index, found, truth, ms, exhaustive_ms, command)

    rows = sweep(index, settings, measure, args.build_threads)
    index.close()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return rows


# -- output --------------------------------------------------------------------------------------------------
def write_csv(rows: Sequence[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if isinstance(v, float) and np.isnan(v) else v for k, v in dataclasses.asdict(r).items()})


def read_row(r: dict[str, str]) -> Row:
    """A CSV row; rows written before the backend column are FAISS rows."""
    n = {c: float(r[c]) if r[c] != "" else float("nan") for c in COLUMNS[5:11]}  # blank: not timed
    return Row(r["collection"], int(r["images"]), r.get("backend") or "faiss", r["index_type"], r["params"],
               n["agreement_at_10"], n["p50_ms"], n["p99_ms"], n["exhaustive_p50_ms"], n["speedup"],
               n["bytes_per_fragment"], r["command"], r.get("peak_rss_mb") or "",
               r.get("disk_bytes_per_image") or "", r.get("build_images_per_s") or "", r.get("load_avg") or "")


def plot(rows: Sequence[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    markers = {"flat": "o", "hnsw": "^", "ivf": "s", "ivfpq": "D"}
    for i, collection in enumerate(dict.fromkeys(r.collection for r in rows)):
        mine = [r for r in rows if r.collection == collection and not np.isnan(r.p50_ms)]
        if not mine:
            continue
        colour = f"C{i}"
        for r in mine:
            ax.scatter(r.p50_ms, r.agreement_at_10, color=colour, marker=markers.get(r.index_type, "x"), s=40)
        ax.axvline(mine[0].exhaustive_p50_ms, color=colour, lw=1, ls="--", alpha=0.6)
        ax.scatter([], [], color=colour, label=f"{collection} ({mine[0].images} items; dashed: exhaustive p50)")
    for kind, m in markers.items():
        ax.scatter([], [], color="grey", marker=m, label=kind)
    ax.set_xscale("log")
    ax.set_xlabel("indexed search p50 latency (ms, retrieval only)")
    ax.set_ylabel("agreement@10 with exhaustive exact S_kl")
    ax.axhline(0.99, color="grey", lw=0.8, ls=":")
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Fragment index: candidate stage + exact re-rank vs exhaustive S_kl")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_path(),
                    help="the model (a model folder or a trainer's model.pt); default: the served model "
                         "(model/release.py: the released one unless FRAGSEARCH_MODEL_PATH or FRAGSEARCH_VARIANT "
                         "names another)")
    ap.add_argument("--data", type=Path, default=default_data_dir(),
                    help="the Flickr8K folder (default: FRAGSEARCH_DATA or ../shared/data/flickr8k)")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(),
                    help="the feature, parse and vector cache (git-ignored); default: artifacts/cache")
    ap.add_argument("--workdir", type=Path, default=default_artifacts_dir() / "bench" / "index",
                    help="where the benchmark's indexes are built (removed after)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/index-bench.csv"), help="the CSV written")
    ap.add_argument("--label", default="",
                    help="the dev-image rows' collection: 'flickr8k-dev (LABEL)', another model's rows")
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000], help="synthetic collection sizes")
    ap.add_argument("--h", type=int, default=None, help="synthetic dimension (default: the model's, else 1000)")
    ap.add_argument("--queries", type=int, default=50, help="synthetic queries")
    ap.add_argument("--exhaustive-timed", type=int, default=5, help="queries timed exhaustively on large collections")
    ap.add_argument("--dev-queries", type=int, default=1000, help="dev captions used as queries of the dev-image rows")
    ap.add_argument("--annotate-queries", type=int, default=50, help="dev images used as queries of the annotate rows")
    ap.add_argument("--skip-dev", action="store_true", help="leave out the dev-image rows")
    ap.add_argument("--skip-annotate", action="store_true", help="leave out the image -> sentence rows")
    ap.add_argument("--annotate-only", action="store_true",
                    help="only the image -> sentence rows (the dev images' fragments as queries)")
    ap.add_argument("--backends", nargs="*", default=[], choices=BACKENDS,
                    help="also measure the dev images on these candidate backends side by side")
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes")
    ap.add_argument("--threads", type=int, default=1, help="the model's and FAISS threads while measuring")
    ap.add_argument("--build-threads", type=int, default=2, help="FAISS threads while building")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic index folders")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of other collections already in --out (replace those measured now)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    command = "python -m bench.index_bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    rows: list[Row] = []
    bundle = Bundle.load(args.model) if model_file(args.model).is_file() else None
    if bundle is None:
        logger.warning("no model at %s: no dev-image rows, synthetic h = %d", args.model, args.h or 1000)
    elif args.annotate_only:
        rows += annotate_rows(args, bundle, dev_fragments(args, bundle)[3], command)
    elif not args.skip_dev:
        rows += dev_rows(args, bundle, command) if not args.backends else backend_rows(args, bundle, command)
    h = args.h or (bundle.dim if bundle is not None else 1000)
    for n in args.sizes:
        rows += synthetic_rows(args, n, h, command)
    if args.append and args.out.is_file():
        with open(args.out, newline="") as f:
            old = [read_row(r) for r in csv.DictReader(f)]
        mine = {r.collection for r in rows}
        rows = [r for r in old if r.collection not in mine] + rows
    write_csv(rows, args.out)
    plot(rows, args.out.with_suffix(".png"))
    logger.info("wrote %s and %s (%d rows) in %.0f s", args.out, args.out.with_suffix(".png"), len(rows),
                time.perf_counter() - t0)


if __name__ == "__main__":
    main()
