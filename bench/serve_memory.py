"""What the service holds in memory, step by step: the resident set (VmRSS) after each part a start loads,
in this process, over indexes built already (a first start's, e.g. `bench.first_start --keep-artifacts`).

    python -m bench.serve_memory --artifacts /tmp/kept-artifacts --out docs/results/serve-memory.json

The steps run in a child process that torch is kept out of, as the runtime environment has it (where torch is
installed, spaCy's thinc imports it and adds about 500 MB). Steps: the imports, the released model, one
sentence encoded, the image index, the sentence index, then one search and one annotation. Writes the rows
with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from bench import machine, parse_run, run_without_torch
from fragsearch.settings import Settings, default_artifacts_dir, default_data_dir

logger = logging.getLogger("bench.serve_memory")


def resident_mb() -> float:
    """This process's resident set in MB."""
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**20


def steps(artifacts: str, model: str | None, data: str) -> list[dict[str, Any]]:
    """The resident set after each part a start loads (run by the child process)."""
    rows: list[dict[str, Any]] = [{"step": "python", "rss_mb": round(resident_mb(), 1)}]

    def step(name: str) -> None:
        rows.append({"step": name, "rss_mb": round(resident_mb(), 1)})
        logger.info("%-40s %8.1f MB", name, rows[-1]["rss_mb"])

    import faiss  # noqa: F401
    import fastapi  # noqa: F401
    import numpy  # noqa: F401
    import onnxruntime  # noqa: F401
    from PIL import Image

    from fragsearch.index.images import ImageIndex
    from fragsearch.index.sentences import SentenceIndex
    from fragsearch.model.bundle import Bundle

    step("imports")
    root = Path(artifacts)
    settings = Settings(artifacts=root)  # the indexes opened as the service opens them (`candidates_mapped`)
    bundle = Bundle.load(Path(model) if model else settings.model_path)
    step("the released model")
    bundle.text.encode(["a dog runs on the grass"], strict=False)
    step("one sentence encoded")
    images = ImageIndex.load(root / "index" / "images-dev", bundle, backend=settings.backend)
    step(f"the image index ({len(images)} images)")
    sentences = SentenceIndex.load(root / "index" / "sentences-train", bundle, backend=settings.backend)
    step(f"the sentence index ({len(sentences)} sentences)")
    images.search("a black dog runs through the grass", k=10)
    step("one search")
    first = (Path(data) / "dev.txt").read_text().split()[0]
    sentences.annotate(Image.open(Path(data) / "images" / first).convert("RGB"), k=5)
    step("one annotation")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, default=default_artifacts_dir(),
                    help="the folder holding index/images-dev and index/sentences-train")
    ap.add_argument("--model", type=Path, default=None, help="the model (default: the served one)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder (the annotated image)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/serve-memory.json"), help="the rows written")
    args, command = parse_run(ap, argv, "bench.serve_memory")
    params = [str(args.artifacts), str(args.model) if args.model else None, str(args.data)]
    rows = run_without_torch("bench.serve_memory:steps", params)
    for row in rows:
        logger.info("%-40s %8.1f MB", row["step"], row["rss_mb"])
    out = {"steps": rows, "machine": machine(), "command": command}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
