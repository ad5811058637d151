"""The sentence index's candidate copy in float32 (FAISS Flat) and float16 (FAISS SQfp16), side by side: the
memory each holds once loaded, what an annotation costs and whether it ranks the same.

    python -m bench.candidate_copy --artifacts /tmp/kept-artifacts --images 300 \
        --out docs/results/candidate-copy.csv

Over a first start's artifacts (`bench.first_start --keep-artifacts`: the released model's sentence index of
the 30,000 training captions, their parses and caption vectors cached, the dev images' features cached): the
sentence index is built again for each precision from those caches (`index.build.build_sentence_index`, the
service's settings but `candidate_dtype`), then each is loaded in a child process of its own (torch kept out,
as in the runtime), which records its resident set before and after the load and annotates the first
`--images` dev images from their cached features (top 10, the service's settings). The rows: per precision,
the FAISS file's size, the load's resident growth, the annotation's median milliseconds; the share of
images whose top 10 is the float32 copy's (same captions in the same order) and the largest score difference.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from bench import machine, parse_run, run_without_torch, write_rows
from bench.serve_memory import resident_mb
from fragsearch.model.resources import cpu_record
from fragsearch.settings import Settings, default_artifacts_dir, default_data_dir

logger = logging.getLogger("bench.candidate_copy")

DTYPES = ("float32", "float16")

def build(artifacts: Path, data: Path, dtype: str) -> Path:
    """The sentence index of the training captions with a `dtype` candidate copy, from the cached parses and
    caption vectors (made once; the float32 one is the first start's own)."""
    from fragsearch.index.build import build_sentence_index
    from fragsearch.index.sentences import DEFAULT_SETTINGS
    from fragsearch.model.bundle import Bundle
    from fragsearch.model.data import load_split
    from fragsearch.service.collection import new_index_settings

    settings = Settings(artifacts=artifacts, data=data)  # type: ignore[call-arg]
    target = artifacts / "index" / f"sentences-train-{dtype}"
    if target.exists():
        return target
    bundle = Bundle.load(settings.model_path)
    sentences, _ = load_split(data, "train").sentences()
    index = build_sentence_index(bundle, sentences, target,
                                 new_index_settings(settings, DEFAULT_SETTINGS.with_shape(candidate_dtype=dtype)),
                                 parse_dir=settings.cache / "parses", vectors_dir=settings.cache / "vectors")
    index.close()
    return target


def annotate_all(artifacts: str, data: str, index_dir: str, images: int) -> dict[str, Any]:
    """In the child: load the model and the index, annotate the first `images` dev images from the feature
    cache; the resident set around the load, each annotation's time and top 10."""
    from fragsearch.index.sentences import SentenceIndex
    from fragsearch.model.bundle import Bundle
    from fragsearch.model.data import load_split
    from fragsearch.model.dataset import feature_cache

    settings = Settings(artifacts=Path(artifacts), data=Path(data))  # type: ignore[call-arg]
    bundle = Bundle.load(settings.model_path)
    split = load_split(Path(data), "dev").subset(images)
    cache = feature_cache(settings.cache, bundle.image_cfg)
    frags = cache.load([split.image_path(n) for n in split.images])
    before = resident_mb()
    index = SentenceIndex.load(Path(index_dir), bundle)
    after = resident_mb()
    index.annotate(frags[0], 10)  # the first call's one-time costs left out of the timings
    times, tops = [], []
    for f in frags:
        t0 = time.perf_counter()
        hits = index.annotate(f, 10).hits
        times.append((time.perf_counter() - t0) * 1000)
        tops.append([[h.sentence_id, h.score] for h in hits])
    faiss_files = sorted(Path(index_dir).glob("faiss-*"), key=lambda p: p.stat().st_mtime)
    return {"load_mb": after - before, "rss_mb": after, "ms": times, "tops": tops,
            "faiss_mb": faiss_files[-1].stat().st_size / 2**20 if faiss_files else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, default=default_artifacts_dir(),
                    help="a first start's artifacts: index/sentences-train, cache/parses, cache/vectors, the features")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--images", type=int, default=300, help="dev images annotated by each copy")
    ap.add_argument("--out", type=Path, default=Path("docs/results/candidate-copy.csv"), help="the rows written")
    args, command = parse_run(ap, argv, "bench.candidate_copy")
    results: dict[str, dict[str, Any]] = {}
    for dtype in DTYPES:
        index_dir = build(args.artifacts, args.data, dtype)
        params = [str(args.artifacts), str(args.data), str(index_dir), args.images]
        results[dtype] = run_without_torch("bench.candidate_copy:annotate_all", params)
        logger.info("%s: load +%.0f MB, annotation median %.1f ms", dtype, results[dtype]["load_mb"],
                    statistics.median(results[dtype]["ms"]))
    base = results["float32"]["tops"]
    cpu = cpu_record()
    rows = []
    for dtype in DTYPES:
        r = results[dtype]
        same = sum([h[0] for h in a] == [h[0] for h in b] for a, b in zip(base, r["tops"], strict=True))
        diff = max((abs(x[1] - y[1]) for a, b in zip(base, r["tops"], strict=True) for x, y in zip(a, b, strict=False)),
                   default=0.0)
        rows.append({"candidate_dtype": dtype, "images": len(r["tops"]),
                     "faiss_mb": None if r["faiss_mb"] is None else round(r["faiss_mb"], 1),
                     "load_rss_mb": round(r["load_mb"], 1), "rss_after_load_mb": round(r["rss_mb"], 1),
                     "annotate_median_ms": round(statistics.median(r["ms"]), 2),
                     "same_top10_as_float32": round(same / len(base), 4), "max_score_diff": f"{diff:.2e}",
                     "machine": machine(), "cpu_flags": " ".join(cpu["flags"]), "command": command})
    for row in rows:
        logger.info("%s", row)
    write_rows(args.out, list(rows[0]), rows)


if __name__ == "__main__":
    main()
