"""The candidate stage on a Milvus 2.3.5 standalone server, side by side with FAISS and milvus-lite in one run.

    python -m bench.milvus_server --out docs/results/milvus-server.json --sizes 2000 5000   # docs/scale/milvus.md
    python -m bench.milvus_server --sizes 20000 --dev-queries 200 --kills 3

It runs itself in a network namespace of its own (loopback only; bench.milvus_local), where it starts
the server (from the `milvus` package of the dev lock) on a folder under --workdir.

For each collection (the Flickr8K dev images' fragments with the served model, from the feature cache;
synthetic collections of N images x 20 fragments in the model's h, bench.index_bench.Synthetic) the
same image index is built on each backend (flat, k' = 128, the candidate stage always on), and the
same queries run through each:

- candidate agreement: per query, the items the candidate stage hands to the exact re-rank
  (index.ranker.candidates); the server's against milvus-lite's (both the k' nearest items per
  query fragment: identical sets expected, the server's grouped by the backend, milvus-lite's by
  itself) and against FAISS's (the items of the k' nearest fragments, a subset of those);
- agreement@10 of the ranked answer with the exhaustive exact S_kl ranking;
- p50 / p99 of the search (candidates + exact re-rank) and of the candidate stage alone.

Consistency, on the server: the p50 of a candidate search at Strong, Bounded and Session consistency and
at the backend's own guarantee timestamp (steady, and the first search after a write), and how often a
row deleted just before comes back in the next search at each. Ready after SIGKILL: the server killed
with its collections loaded, started again on its data: seconds to healthy, to the dev index opened
(its collection loaded) and to its first answer.

Writes one JSON file with the CPU (model, flags), the server's version and the command, after each
stage (dev, consistency, restarts, then each synthetic size): a run that stops keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import psutil
from tqdm import tqdm

from bench import machine, parse_run
from bench.index_bench import N_FRAGMENTS, K, Synthetic, agreement, dev_queries, scoring_bundle
from bench.milvus_local import LocalServer, isolated, loopback_up, own_namespace
from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index import ids as fid
from fragsearch.index.images import embedded_images, exact_top_k
from fragsearch.index.milvus import VECTOR, MilvusCandidates
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.dataset import feature_cache
from fragsearch.model.embed import EmbeddedSentence
from fragsearch.model.onnx import set_threads
from fragsearch.model.resources import cpu_info
from fragsearch.settings import (
    BackendOptions,
    default_artifacts_dir,
    default_cache_dir,
    default_data_dir,
    default_model_path,
)

logger = logging.getLogger("bench.milvus_server")

BACKENDS = ("faiss", "milvus-lite", "milvus-server")
SETTINGS = IndexSettings.of(exact_below=0)  # flat, k' = 128: every search goes through the candidate stage
CONSISTENCY_ROWS = 2000  # items of the scratch collection the consistency trials write to


def options(name: str, server: LocalServer) -> BackendOptions:
    if name == "faiss":
        return BackendOptions("faiss")
    return BackendOptions("milvus", server.uri if name == "milvus-server" else None)


def percentiles(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def timed_runs(fn: Callable[[int], Any], n: int, desc: str) -> tuple[list[Any], list[float]]:
    out, ms = [], []
    for q in tqdm(range(n), desc=desc, unit="query", leave=False):
        t0 = time.perf_counter()
        out.append(fn(q))
        ms.append(1000 * (time.perf_counter() - t0))
    return out, ms


def candidates_of(index: ImageIndex, query: np.ndarray) -> np.ndarray:
    with index.reading():
        return index.ranker.candidates(query)


def overlap(mine: list[np.ndarray], theirs: list[np.ndarray]) -> dict[str, float]:
    """Mean |mine ∩ theirs| / |theirs| and the share of queries with identical sets."""
    cover = [len(np.intersect1d(a, b)) / max(1, len(b)) for a, b in zip(mine, theirs, strict=True)]
    same = [len(a) == len(b) and bool(np.all(np.sort(a) == np.sort(b))) for a, b in zip(mine, theirs, strict=True)]
    return {"covers": round(float(np.mean(cover)), 4), "identical_sets": round(float(np.mean(same)), 4)}


def compare(label: str, indexes: dict[str, ImageIndex], queries: list[np.ndarray]) -> dict[str, Any]:
    """The same queries through each backend's index: candidates, answers, times."""
    first = next(iter(indexes.values()))
    truth = [[i for i, _ in r] for r in exact_top_k(first, queries, K)]
    out: dict[str, Any] = {"items": len(first), "fragments": first.n_fragments, "queries": len(queries), "k": K,
                           "k_prime": SETTINGS.search.k_prime, "backends": {}}
    cands: dict[str, list[np.ndarray]] = {}
    for name, index in indexes.items():
        index.set_search(exact_below=0)
        for q in queries[:3]:  # warm-up: the first search after a build waits for the server's time tick
            index.search(EmbeddedSentence(q), K)
        def recall(q: int, index: ImageIndex = index) -> np.ndarray:
            return candidates_of(index, queries[q])

        def search(q: int, index: ImageIndex = index) -> list[int]:
            return [h.image_id for h in index.search(EmbeddedSentence(queries[q]), K).hits]

        cands[name], cand_ms = timed_runs(recall, len(queries), f"{label} {name} candidates")
        found, ms = timed_runs(search, len(queries), f"{label} {name} search")
        row: dict[str, Any] = {"agreement_at_10": round(agreement(found, truth), 4), "search": percentiles(ms),
               "candidate_stage": percentiles(cand_ms),
               "candidates_per_query": round(float(np.mean([len(c) for c in cands[name]])), 1)}
        if isinstance(index.candidates, MilvusCandidates):
            row["server_version"] = index.candidates.server_version
            row["grouped_by"] = "server" if index.candidates.groups_on_server else "fragsearch"
        out["backends"][name] = row
        logger.info("%s %-13s agree@10 %.3f  search p50 %.1f ms  candidates p50 %.1f ms  %.0f candidates",
                    label, name, row["agreement_at_10"], row["search"]["p50_ms"], row["candidate_stage"]["p50_ms"],
                    row["candidates_per_query"])
    out["candidate_agreement"] = {"server_vs_lite": overlap(cands["milvus-server"], cands["milvus-lite"]),
                                  "server_covers_faiss": overlap(cands["milvus-server"], cands["faiss"])}
    logger.info("%s candidates: %s", label, out["candidate_agreement"])
    return out


# -- collections --------------------------------------------------------------------------------------------
def dev_indexes(args: argparse.Namespace, bundle: Bundle, server: LocalServer) -> tuple[dict[str, ImageIndex],
                                                                                      list[np.ndarray]]:
    split = load_split(args.data, "dev")
    paths = [split.image_path(n) for n in split.images]
    cache = feature_cache(args.cache, bundle.image_cfg)
    cache.ensure(paths, workers=args.workers)
    frags = cache.load(paths)
    indexes = {}
    for name in BACKENDS:
        index = ImageIndex.create(args.workdir / f"dev-{name}", bundle, SETTINGS, cache=cache,
                                  backend=options(name, server))
        index.add(frags, list(split.images), paths)
        index.save()
        indexes[name] = index
    return indexes, dev_queries(bundle, split, args.dev_queries)


def synthetic_indexes(args: argparse.Namespace, n_images: int, h: int, server: LocalServer
                      ) -> tuple[dict[str, ImageIndex], list[np.ndarray]]:
    gen = Synthetic(h)
    bundle = scoring_bundle(h)
    chunk = 2048
    boxes = np.tile(np.array([0, 0, 224, 224], np.float32), (chunk, N_FRAGMENTS, 1))
    indexes = {}
    for name in BACKENDS:
        t0 = time.perf_counter()
        index = ImageIndex.create(args.workdir / f"synthetic-{n_images}-{name}", bundle, SETTINGS,
                                  backend=options(name, server))
        with index.bulk():
            for start in tqdm(range(0, n_images, chunk), desc=f"synthetic {n_images} {name}", unit="chunk"):
                count = min(chunk, n_images - start)
                names = [f"syn{start + i:07d}" for i in range(count)]
                index.add(embedded_images(gen.images(start, count), boxes[:count], np.full((count, 2), 224)), names,
                          names, read_places=False)
        index.save()
        logger.info("synthetic %d on %s: built in %.1f s", n_images, name, time.perf_counter() - t0)
        indexes[name] = index
    return indexes, gen.queries(args.queries)


# -- consistency ----------------------------------------------------------------------------------------------
def consistency(server: LocalServer, workdir: Path, trials: int, dim: int = 64) -> dict[str, Any]:
    """Search latency at each consistency level, and rows deleted just before that come back."""
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((CONSISTENCY_ROWS * N_FRAGMENTS, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    ids = np.concatenate([fid.item_fragments(i, N_FRAGMENTS) for i in range(CONSISTENCY_ROWS)])
    (workdir / "consistency").mkdir(parents=True, exist_ok=True)
    backend = MilvusCandidates.create(workdir / "consistency", dim, IndexSettings(), BackendOptions("milvus",
                                                                                                   server.uri),
                                      "images")
    try:
        backend.add(ids, vecs)
        backend.client.flush(backend.collection)
        client, name = backend.client, backend.collection
        conn = client._get_connection()
        params = {"metric_type": "IP", "params": {}}

        def search(q: np.ndarray, level: str) -> list[int]:
            extra: dict[str, Any] = ({"consistency_level": "Customized", "guarantee_timestamp": conn.alloc_timestamp()}
                                     if level == "guarantee" else {"consistency_level": level})
            hits = client.search(name, data=[q], limit=5, anns_field=VECTOR, search_params=params, **extra)
            return [int(h["id"]) for h in hits[0]]

        out: dict[str, Any] = {"rows": len(ids), "dim": dim, "trials": trials, "levels": {}}
        row = 0
        for level in ("Strong", "Bounded", "Session", "guarantee"):
            steady = []
            for t in range(trials):  # no write before: the steady state
                t0 = time.perf_counter()
                search(vecs[(7 * t) % len(vecs)], level) if level != "guarantee" else backend.search(
                    vecs[(7 * t) % len(vecs)][None], 5)
                steady.append(1000 * (time.perf_counter() - t0))
            after, stale = [], 0
            for _ in range(trials):  # a row deleted, then at once a search for its own vector
                row += 37
                client.delete(name, ids=[int(ids[row])])
                t0 = time.perf_counter()
                found = search(vecs[row], level)
                after.append(1000 * (time.perf_counter() - t0))
                stale += int(ids[row]) in found
            out["levels"][level] = {"steady_p50_ms": round(float(np.median(steady)), 2),
                                    "after_delete_p50_ms": round(float(np.median(after)), 2),
                                    "deleted_row_returned": f"{stale}/{trials}"}
            logger.info("consistency %-9s steady p50 %.1f ms, first search after a delete p50 %.1f ms, "
                        "deleted row returned %d/%d", level, out["levels"][level]["steady_p50_ms"],
                        out["levels"][level]["after_delete_p50_ms"], stale, trials)
        out["levels"]["guarantee"]["note"] = ("the backend's own: a server timestamp taken after its last write "
                                              "(AllocTimestamp) as the guarantee timestamp; steady = no write since")
        return out
    finally:
        backend.discard()


# -- restart after SIGKILL -----------------------------------------------------------------------------------
def restarts(server: LocalServer, root: Path, bundle: Bundle, query: np.ndarray, kills: int
             ) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    with ImageIndex.load(root, bundle) as index:
        assert isinstance(index.candidates, MilvusCandidates)
        held = len(index.candidates.client.list_collections())
    for trial in range(kills):
        server.kill()
        t0 = time.perf_counter()
        healthy = server.start()
        index = ImageIndex.load(root, bundle)
        opened = time.perf_counter() - t0
        hits = index.search(EmbeddedSentence(query), K).hits
        answered = time.perf_counter() - t0
        assert hits, "no answer after the restart"
        index.close()
        out.append({"collections": held, "healthy_s": round(healthy, 1), "index_opened_s": round(opened, 1),
                    "first_answer_s": round(answered, 1)})
        logger.info("restart %d after SIGKILL: healthy %.1f s, index opened %.1f s, first answer %.1f s", trial,
                    healthy, opened, answered)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_path(),
                    help="the checkpoint (model.pt); default: the served model")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature cache")
    ap.add_argument("--workdir", type=Path, default=default_artifacts_dir() / "bench" / "milvus-server",
                    help="the server's data and the indexes (removed first)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/milvus-server.json"), help="the JSON written")
    ap.add_argument("--sizes", type=int, nargs="*", default=[2000], help="synthetic collection sizes (images)")
    ap.add_argument("--dev-queries", type=int, default=20, help="dev captions used as queries")
    ap.add_argument("--queries", type=int, default=10, help="synthetic queries")
    ap.add_argument("--trials", type=int, default=10, help="searches per consistency level")
    ap.add_argument("--kills", type=int, default=2, help="SIGKILLs of the server (the ready time after each)")
    ap.add_argument("--workers", type=int, default=2, help="feature extraction processes (features not cached)")
    ap.add_argument("--threads", type=int, default=1, help="the model's and FAISS threads")
    if not isolated():  # the server listens on every interface it sees: run in a namespace of its own
        cmd = own_namespace([sys.executable, "-m", "bench.milvus_server", *(sys.argv[1:] if argv is None else argv)])
        return os.spawnvp(os.P_WAIT, cmd[0], cmd)
    args, command = parse_run(ap, argv, "bench.milvus_server")
    loopback_up()
    set_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    server = LocalServer(args.workdir / "server")
    healthy = server.start()
    cpu = cpu_info()
    report: dict[str, Any] = {
        "command": command, "machine": machine(),
        "cpu": {"model": cpu.model, "mhz": cpu.mhz, "flags": sorted(cpu.flags)},
        "python": platform.python_version(), "threads": args.threads,
        "server": {"package": "milvus==2.3.5 (standalone, in a network namespace of its own)",
                   "first_start_healthy_s": round(healthy, 1)},
    }

    def written(stage: str) -> None:
        """The report so far, written after each stage: a run that stops keeps what it measured."""
        report["seconds"] = round(time.perf_counter() - began)
        report["load_avg"] = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
        report["peak_rss_mb"] = round(psutil.Process().memory_info().rss / 2**20)
        report["completed"] = stage
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    try:
        bundle = Bundle.load(args.model)
        dev, queries = dev_indexes(args, bundle, server)
        report["flickr8k_dev"] = compare("dev", dev, queries)
        written("flickr8k_dev")
        server_index = dev["milvus-server"]
        assert isinstance(server_index.candidates, MilvusCandidates)
        report["server"]["version"] = server_index.candidates.server_version
        for index in dev.values():
            index.close()
        report["consistency"] = consistency(server, args.workdir, args.trials)
        written("consistency")
        report["restart_after_sigkill"] = restarts(server, args.workdir / "dev-milvus-server", bundle, queries[0],
                                                   args.kills)
        written("restart_after_sigkill")
        report["synthetic"] = {}
        for n in args.sizes:
            synthetic, squeries = synthetic_indexes(args, n, bundle.dim, server)
            report["synthetic"][str(n)] = compare(f"synthetic-{n}", synthetic, squeries)
            for index in synthetic.values():
                index.close()
            written(f"synthetic-{n}")
    except BaseException as e:
        report["stopped_by"] = f"{type(e).__name__}: {e}"
        written(report.get("completed", "none"))
        raise
    finally:
        server.stop()
    written("all")
    logger.info("wrote %s in %.0f s", args.out, time.perf_counter() - began)
    return 0


if __name__ == "__main__":
    sys.exit(main())
