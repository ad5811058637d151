"""What reading a page of results costs: each image's phrase evidence and grounding one image at a time, against
the page's images of as many fragments read in one product (index/matches.py `aligned_all`), side by side on
the same pages.

    python -m fragsearch.index.build --model model/released --images ../shared/data/flickr8k/images \
        --image-list ../shared/data/flickr8k/dev.txt --out artifacts/index/images-dev
    python -m bench.page_read --index artifacts/index/images-dev --out docs/results/page-read.csv

The first N dev captions are searched in a built image index (the released model by default); for each, its
page of k results is aligned both ways in turn, so a busy machine slows both alike. Writes the median and p90
milliseconds of each, their ratio, and the largest difference between the two ways' `found`.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench import machine, parse_run, write_rows
from bench.photo_decode import cpu_flags
from fragsearch.index.images import ImageIndex, skl_of_items
from fragsearch.index.matches import aligned, aligned_all, read_sentence
from fragsearch.index.ranker import exact_score
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.embed import embed_sentence
from fragsearch.model.onnx import set_threads
from fragsearch.model.release import RELEASED_MODEL
from fragsearch.settings import default_artifacts_dir, default_data_dir

logger = logging.getLogger("bench.page_read")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=RELEASED_MODEL, help="the model (default: the released one)")
    ap.add_argument("--index", type=Path, default=default_artifacts_dir() / "index" / "images-dev",
                    help="a built image index of the model")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder (its dev captions)")
    ap.add_argument("--n", type=int, default=200, help="queries: the first N dev captions")
    ap.add_argument("--k", type=int, default=10, help="results on a page")
    ap.add_argument("--out", type=Path, default=Path("docs/results/page-read.csv"), help="the results CSV")
    args, command = parse_run(ap, argv, "bench.page_read")
    set_threads(1)
    bundle = Bundle.load(args.model)
    index = ImageIndex.load(args.index, bundle)
    sentences, _ = load_split(args.data, "dev").sentences()
    alone: list[float] = []
    together: list[float] = []
    largest = 0.0
    for text in tqdm(sentences[: args.n], desc="pages", unit="page"):
        sent, triplets = embed_sentence(bundle, text)
        ranked, *_ = index.ranker.rank(sent, exact_score(bundle, [sent], "images"), args.k, False, None,
                                       skl_of_items)
        reading = read_sentence(bundle, sent, triplets)
        imgs = [frags for *_, frags in ranked]
        boxes = [p.boxes for _, _, p, _ in ranked]
        labels = [p.labels for _, _, p, _ in ranked]
        t0 = time.perf_counter()
        one = [aligned(img, sent, triplets, b, bundle.blocks, lab, reading) for img, b, lab in
               zip(imgs, boxes, labels, strict=True)]
        t1 = time.perf_counter()
        many = aligned_all(imgs, sent, triplets, boxes, bundle.blocks, labels, reading)
        t2 = time.perf_counter()
        alone.append(1000 * (t1 - t0))
        together.append(1000 * (t2 - t1))
        for (_, f1), (_, f2) in zip(one, many, strict=True):
            if f1 is not None and f2 is not None and f1.things:
                largest = max(largest, max(abs(f1.things[w] - f2.things[w]) for w in f1.things))
    rows: list[dict[str, object]] = [
        {"way": way, "pages": len(ms), "k": args.k, "median_ms": round(float(np.median(ms)), 2),
         "p90_ms": round(float(np.percentile(ms, 90)), 2),
         "ratio_to_one_product": round(float(np.median(ms) / np.median(together)), 2),
         "largest_found_difference": f"{largest:.1e}", "machine": machine(), "cpu_flags": cpu_flags(),
         "command": command}
        for way, ms in (("each image alone", alone), ("one product per fragment count", together))]
    for r in rows:
        logger.info("%s", r)
    write_rows(args.out, list(rows[0]), rows)


if __name__ == "__main__":
    main()
