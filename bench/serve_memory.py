"""What the service holds in memory, step by step: the resident set (VmRSS) after each part a start loads,
in this process, over indexes built already (a first start's, e.g. `bench.first_start --keep-artifacts`).

    python -m bench.serve_memory --artifacts /tmp/kept-artifacts --out docs/results/serve-memory.json

Run it in the runtime's environment (`./run serve` makes it; no torch there, as in the service: where torch
is installed, spaCy's thinc imports it and adds about 500 MB). Steps: the imports, the released model, one
sentence encoded, the image index, the sentence index, then one search and one annotation. Writes the rows
with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from bench import machine, parse_run
from model.config import default_artifacts_dir, default_data_dir
from model.release import served_model_from_env

logger = logging.getLogger("bench.serve_memory")


def resident_mb() -> float:
    """This process's resident set in MB (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, default=default_artifacts_dir(),
                    help="the folder holding index/images-dev and index/sentences-train")
    ap.add_argument("--model", type=Path, default=None, help="the model (default: the served one)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder (the annotated image)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/serve-memory.json"), help="the rows written")
    args, command = parse_run(ap, argv, "bench.serve_memory")
    steps: list[dict[str, Any]] = [{"step": "python", "rss_mb": round(resident_mb(), 1)}]

    def step(name: str) -> None:
        steps.append({"step": name, "rss_mb": round(resident_mb(), 1)})
        logger.info("%-40s %8.1f MB", name, steps[-1]["rss_mb"])

    import importlib.util

    import faiss  # noqa: F401
    import fastapi  # noqa: F401
    import numpy  # noqa: F401
    import onnxruntime  # noqa: F401
    from PIL import Image

    from index.images import ImageIndex
    from index.sentences import SentenceIndex
    from model.bundle import Bundle

    step("imports")
    bundle = Bundle.load(args.model or served_model_from_env(args.artifacts))
    step("the released model")
    bundle.text.encode(["a dog runs on the grass"], strict=False)
    step("one sentence encoded")
    images = ImageIndex.load(args.artifacts / "index" / "images-dev", bundle)
    step(f"the image index ({len(images)} images)")
    sentences = SentenceIndex.load(args.artifacts / "index" / "sentences-train", bundle)
    step(f"the sentence index ({len(sentences)} sentences)")
    images.search("a black dog runs through the grass", k=10)
    step("one search")
    first = (args.data / "dev.txt").read_text().split()[0]
    sentences.annotate(Image.open(args.data / "images" / first).convert("RGB"), k=5)
    step("one annotation")
    out = {"steps": steps, "torch_importable": importlib.util.find_spec("torch") is not None,
           "machine": machine(), "command": command}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
