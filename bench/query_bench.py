"""Where a `/search/images` query's time goes, stage by stage, on a built image index.

    python -m bench.query_bench --model artifacts/models/full/model.pt --index artifacts/index/images-dev

Several models are measured side by side in one run (`--model A B --index IA IB`): each query goes
through every model in turn, so a busy machine slows them alike and the ratios between them hold. So do
the ways of the large products (`--products onnxruntime float-references blas`, model/product.py): the scan's and
the calibration's products through ONNX Runtime, as served (the calibration's reference images through their
8-bit codes), the same with the references in float32, or all through NumPy's BLAS; NumPy's BLAS and the
products run on `--threads` threads, as a served request's share of the cores does.

Runs the first N dev captions (each seen for the first time, as a user's query is) through the
same calls the service makes, timing each stage in this process: parse (spaCy), word vectors
(MiniLM: the words in context and the whole sentence), encoders, the calibration scale (one S_kl
against the reference image fragments), retrieval (the index's search: the exact scan of a small
collection, else FAISS candidates + the exact re-rank; with the alignment of each of the k hits)
and the response (pydantic + JSON). Writes docs/results/query-stages.csv: per stage the median /
p90 milliseconds; `--candidates` forces the candidate stage (SearchSettings.exact_below = 0).
"""

from __future__ import annotations

import argparse
import csv
import logging
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench import machine
from fragsearch.index.images import ImageIndex
from fragsearch.model import product
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.embed import EmbeddedSentence, row_triplets
from fragsearch.model.modelfile import model_file
from fragsearch.model.onnx import limit_numeric_threads, set_threads
from fragsearch.model.release import RELEASED_MODEL, read_manifest
from fragsearch.service.routes.convert import image_result
from fragsearch.service.schemas import SearchImagesResponse
from fragsearch.settings import default_artifacts_dir, default_data_dir, default_model_path

logger = logging.getLogger("bench.query_bench")

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "query-stages.csv"
STAGES = ("parse", "word_vectors", "encoders", "calibration_scale", "retrieval", "response", "total")


class Laps:
    """Milliseconds between successive `lap` calls, by stage name."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.ms: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.ms[stage] = 1000 * (now - self.last)
        self.last = now


def run(bundle: Bundle, index: ImageIndex, sentences: Sequence[str], k: int) -> dict[str, list[float]]:
    """Milliseconds per stage for each sentence."""
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    for text in sentences:
        t = Laps()
        parsed = bundle.text.parse([text])
        t.lap("parse")
        enc = bundle.text.encode_parsed(parsed, [text], strict=True)
        t.lap("word_vectors")
        raw, mask = bundle.embed_sentences(enc, calibrated=False)
        t.lap("encoders")
        if bundle.calibration is not None:
            raw = bundle.calibration.calibrate_sentences(raw, mask, bundle.blocks)
        t.lap("calibration_scale")
        n = int(mask[0].sum())
        hits = index.search(EmbeddedSentence(raw[0, :n], row_triplets(enc.triplets[0], n)), k).hits
        t.lap("retrieval")
        body = SearchImagesResponse(sentence=text, results=[image_result(h) for h in hits],
                                    took_ms=0.0).model_dump_json()
        assert body
        t.lap("response")
        t.ms["total"] = 1000 * (time.perf_counter() - t.start)
        for stage in STAGES:
            times[stage].append(t.ms.get(stage, 0.0))
    return times


PRODUCTS = ("onnxruntime", "float-references", "blas")


@contextmanager
def products(kind: str) -> Iterator[None]:
    """The large products as served ("onnxruntime": model/product.py, the references read through their 8-bit
    codes), the same with the references in float32 ("float-references") or all through NumPy's BLAS in float32
    ("blas")."""
    served, coded = product.LARGE, product.QUANTIZED
    product.LARGE = sys.maxsize if kind == "blas" else served
    product.QUANTIZED = coded and kind == "onnxruntime"
    try:
        yield
    finally:
        product.LARGE, product.QUANTIZED = served, coded


def model_name(path: Path, bundle: Bundle) -> str:
    """A row's model: `released (<its row>)` for the released model, else the model's folder."""
    file = model_file(path)
    if file.resolve() == RELEASED_MODEL.resolve():
        return f"released ({read_manifest().get('row') or bundle.meta.get('variant')})"
    return file.parent.name


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    art = default_artifacts_dir()
    ap.add_argument("--model", type=Path, nargs="+", default=[default_model_path()],
                    help="the models (a model folder or a trainer's model.pt), measured side by side; default: the "
                         "served model (model/release.py: the released one unless FRAGSEARCH_MODEL_PATH or "
                         "FRAGSEARCH_VARIANT names another)")
    ap.add_argument("--index", type=Path, nargs="+", default=[art / "index" / "images-dev"],
                    help="the image index searched with each --model, in order; default: the served dev-image index")
    ap.add_argument("--data", type=Path, default=default_data_dir(),
                    help="the Flickr8K folder (default: FRAGSEARCH_DATA or ../shared/data/flickr8k)")
    ap.add_argument("--n", type=int, default=200, help="queries: the first N dev captions")
    ap.add_argument("--k", type=int, default=10, help="results per query")
    ap.add_argument("--threads", type=int, default=1,
                    help="the model's intra-op threads (ONNX Runtime), NumPy's BLAS threads and the products'")
    ap.add_argument("--products", nargs="+", choices=PRODUCTS, default=["onnxruntime"],
                    help="the ways of the large products measured, side by side (model/product.py): onnxruntime "
                         "(as served: the references through their 8-bit codes), float-references (the same, the "
                         "references in float32), blas (all through NumPy's BLAS in float32)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the CSV written")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in --out and add these after them (a model measured again has its "
                    "rows twice)")
    ap.add_argument("--candidates", action="store_true", help="always use the candidate stage")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    set_threads(args.threads)
    limit_numeric_threads(args.threads)
    if len(args.model) != len(args.index):
        ap.error(f"{len(args.model)} models but {len(args.index)} indexes: one index per model")
    # a model and its index per arm: each arm reads every query for the first time (the text's caches are the
    # model's)
    paths = [(m, ix, kind) for m, ix in zip(args.model, args.index, strict=True) for kind in args.products]
    bundles = [Bundle.load(m) for m, _, _ in paths]
    indexes = [ImageIndex.load(ix, b) for (_, ix, _), b in zip(paths, bundles, strict=True)]
    for index in indexes:
        if args.candidates:
            index.set_search(exact_below=0)
    sentences, _ = load_split(args.data, "dev").sentences()
    queries = sentences[: args.n]
    arms = [(b, ix, kind) for b, ix, (_, _, kind) in zip(bundles, indexes, paths, strict=True)]
    for bundle, index, kind in arms:
        with products(kind):
            run(bundle, index, sentences[-5:], args.k)  # warm-up on other sentences
    times: list[dict[str, list[float]]] = [{s: [] for s in STAGES} for _ in arms]
    for text in tqdm(queries, desc="queries", unit="query"):
        for (bundle, index, kind), t in zip(arms, times, strict=True):
            with products(kind):
                for stage, ms in run(bundle, index, [text], args.k).items():
                    t[stage] += ms
    command = "python -m bench.query_bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    where = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    new = args.append and args.out.is_file()
    with args.out.open("a" if new else "w", newline="") as fh:
        w = csv.writer(fh)
        if not new:
            w.writerow(["model", "images", "search", "products", "stage", "queries", "median_ms", "p90_ms", "threads",
                        "machine", "command"])
        for (path, _, _), (bundle, index, kind), t in zip(paths, arms, times, strict=True):
            name = model_name(path, bundle)
            for stage in STAGES:
                v = np.asarray(t[stage])
                logger.info("%-28s %-11s %-18s median %7.2f ms  p90 %7.2f ms", name, kind, stage, np.median(v),
                            np.percentile(v, 90))
                w.writerow([name, len(index), "candidates" if args.candidates else "default", kind, stage, len(v),
                            f"{np.median(v):.2f}", f"{np.percentile(v, 90):.2f}", args.threads, where, command])
    logger.info("wrote %s", args.out)
    for index in indexes:
        index.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
