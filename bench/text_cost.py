"""What a model's trained MiniLM layers cost where the service reads text: the caption pass (every caption of
the sentence collection read once, as a first start does) and a query (one sentence at a time), side by side
for several models in one run, so that a busy machine slows them alike and the ratios hold:

    python -m bench.text_cost --model artifacts/models/full-val-rerun-2/model.pt \\
        artifacts/models/full-text1/model.pt artifacts/models/full-text2/model.pt \\
        artifacts/models/full-text6/model.pt --out docs/results/text-cost.csv

The captions are the first `--captions` training captions, parsed once beforehand (the parser costs every
model the same); each timing reads them through `TextPipeline.frozen_vectors` with its in-memory caches
emptied: MiniLM's graph alone for a model without trained layers, the cut graph and the model's layers
(model/words.py `encode_tuned`) for one with them. Each model is timed `--rounds` times, the models in turn
within each round; the medians are written, with the ratio to the first model.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import machine, parse_run, write_rows
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.settings import default_data_dir

logger = logging.getLogger("bench.text_cost")


def seconds(bundle: Bundle, parsed: list[Any], sentences: list[str], one_by_one: bool) -> float:
    """Wall seconds to read these sentences' vectors, the caches emptied: in one pass or one at a time."""
    text = bundle.text
    text.forget()
    t0 = time.perf_counter()
    if one_by_one:
        for p, s in zip(parsed, sentences, strict=True):
            text.frozen_vectors([p], [s])
    else:
        text.frozen_vectors(parsed, sentences)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, nargs="+", required=True, help="models (.pt or the runtime's form)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--captions", type=int, default=2000, help="training captions of the caption pass")
    ap.add_argument("--queries", type=int, default=100, help="of them, read one at a time as queries")
    ap.add_argument("--rounds", type=int, default=3, help="timings of each model (medians written)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/text-cost.csv"), help="the CSV written")
    args, command = parse_run(ap, argv, "bench.text_cost")
    bundles = [Bundle.load(m) for m in args.model]
    captions = [c for caps in load_split(args.data, "train").captions for c in caps][: args.captions]
    parsed = bundles[0].text.parse(captions)
    queries = min(args.queries, len(captions))
    timings: dict[str, list[list[float]]] = {str(m): [[], []] for m in args.model}
    for r in range(args.rounds):
        for path, bundle in zip(args.model, bundles, strict=True):
            timings[str(path)][0].append(seconds(bundle, parsed, captions, False))
            timings[str(path)][1].append(seconds(bundle, parsed[:queries], captions[:queries], True))
            logger.info("round %d, %s: %.1f s the pass, %.1f s the queries", r + 1, path,
                        timings[str(path)][0][-1], timings[str(path)][1][-1])
    first = [float(np.median(t)) for t in timings[str(args.model[0])]]
    rows = []
    for path, bundle in zip(args.model, bundles, strict=True):
        pass_s, query_s = (float(np.median(t)) for t in timings[str(path)])
        rows.append({"model": path.parent.name if path.suffix else path.name,
                     "text_layers": bundle.encoders.cfg.text_layers, "captions": len(captions),
                     "pass_s": round(pass_s, 2), "captions_per_s": round(len(captions) / pass_s, 1),
                     "pass_ratio": round(pass_s / first[0], 2),
                     "query_ms": round(1000 * query_s / queries, 2), "query_ratio": round(query_s / first[1], 2),
                     "rounds": args.rounds, "machine": machine(), "command": command})
        logger.info("%s", rows[-1])
    write_rows(args.out, list(rows[0]), rows)


if __name__ == "__main__":
    main()
