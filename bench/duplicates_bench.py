"""Where is the near-duplicate threshold? Altered copies of Flickr8K dev photos against distinct photos.

    python -m bench.duplicates_bench --model artifacts/models/full/model.pt --images 400

Each of the first N dev images is altered in memory (nothing is written): resized to half its side,
re-encoded as JPEG at quality 40, cropped by 4 % on every side, and all three at once. The
whole-image fragment of the original and of each copy (index/duplicates.py: the model's embedding of
the whole-frame CNN feature, what the index stores as row 0) is compared by cosine; so are all pairs
of distinct originals. The threshold is chosen on the first half of the images (the lowest cosine
that no distinct pair of that half reaches, rounded down to 0.005 steps, with a margin of one step),
then reported on the second half: the share of altered copies found (recall) and of distinct pairs
wrongly matched, per alteration. The raw CNN feature (1280-d) is reported beside it for reference.
Writes docs/results/duplicates-dev.csv and duplicates-dev.png.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from bench import machine, parse_run
from fragsearch.model.bundle import Bundle
from fragsearch.model.data import load_split
from fragsearch.model.image import RegionExtractor
from fragsearch.settings import default_data_dir, default_model_path

logger = logging.getLogger("bench.duplicates_bench")
STEP = 0.005


def resized(img: Image.Image) -> Image.Image:
    return img.resize((max(1, img.width // 2), max(1, img.height // 2)), Image.Resampling.BILINEAR)


def reencoded(img: Image.Image) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=40)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def cropped(img: Image.Image, share: float = 0.04) -> Image.Image:
    dx, dy = int(img.width * share), int(img.height * share)
    return img.crop((dx, dy, img.width - dx, img.height - dy))


ALTERATIONS: dict[str, Callable[[Image.Image], Image.Image]] = {
    "resized 50%": resized, "JPEG q40": reencoded, "cropped 4%": cropped,
    "all three": lambda img: reencoded(resized(cropped(img))),
}


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_path(),
                    help="the checkpoint; default: the served model (model/release.py)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--images", type=int, default=400, help="the first N dev images")
    ap.add_argument("--out", type=Path, default=Path("docs/results/duplicates-dev.csv"), help="the CSV written")
    args, command = parse_run(ap, argv, "bench.duplicates_bench")
    bundle = Bundle.load(args.model)
    extractor = RegionExtractor(dataclasses.replace(bundle.image_cfg, full_frame_only=True))  # the whole frame only
    split = load_split(args.data, "dev")
    names = split.images[: args.images]
    versions = ["original", *ALTERATIONS]
    raw = {v: [] for v in versions}  # type: dict[str, list[np.ndarray]]
    for name in tqdm(names, desc="whole-image features", unit="img"):
        with Image.open(split.image_path(name)) as im:
            img = im.convert("RGB")
        copies = [img, *(alter(img) for alter in ALTERATIONS.values())]
        feats = extractor.extract_proposed(copies, [np.zeros((0, 4), np.float32)] * len(copies))
        for v, f in zip(versions, feats, strict=True):
            raw[v].append(f.features[0])
    cnn = {v: unit(np.stack(raw[v])) for v in versions}
    emb = {v: unit(bundle.embed_images(np.stack(raw[v])[:, None], calibrated=False)[:, 0]) for v in versions}
    half = len(names) // 2
    rows = []
    threshold = {}
    for feature, vecs in (("whole-frame fragment", emb), ("raw CNN feature", cnn)):
        orig = vecs["original"]
        pair = orig @ orig.T
        fit, test = np.arange(half), np.arange(half, len(names))
        fit_neg = pair[np.ix_(fit, fit)][np.triu_indices(len(fit), 1)]
        test_neg = pair[np.ix_(test, test)][np.triu_indices(len(test), 1)]
        t = float(np.ceil(fit_neg.max() / STEP) * STEP + STEP)
        threshold[feature] = t
        for v in ALTERATIONS:
            pos = np.sum(orig * vecs[v], axis=1)
            rows.append({"feature": feature, "pairs": f"original vs {v}", "n": len(test),
                         "threshold": round(t, 3), "matched_share": round(float((pos[test] >= t).mean()), 4),
                         "min_cosine": round(float(pos[test].min()), 4),
                         "median_cosine": round(float(np.median(pos[test])), 4)})
        rows.append({"feature": feature, "pairs": "distinct photos", "n": len(test_neg), "threshold": round(t, 3),
                     "matched_share": round(float((test_neg >= t).mean()), 6),
                     "min_cosine": round(float(test_neg.min()), 4),
                     "median_cosine": round(float(np.median(test_neg)), 4)})
        rows[-1]["max_cosine"] = round(float(test_neg.max()), 4)
    for r in rows:
        r.setdefault("max_cosine", "")
        r.update({"fit_images": half, "test_images": len(names) - half, "machine": machine(), "command": command})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        logger.info("%s", {k: v for k, v in r.items() if k not in ("machine", "command")})
    plot(emb, half, threshold["whole-frame fragment"], args.out.with_suffix(".png"))
    logger.info("wrote %s", args.out)


def plot(vecs: dict[str, np.ndarray], half: int, t: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    orig = vecs["original"][half:]
    neg = (orig @ orig.T)[np.triu_indices(len(orig), 1)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.linspace(min(-0.2, float(neg.min())), 1.0, 121).tolist()
    ax.hist(neg, bins=bins, density=True, alpha=0.5, label="distinct photos")
    for v in ALTERATIONS:
        ax.hist(np.sum(orig * vecs[v][half:], axis=1), bins=bins, density=True, histtype="step", linewidth=1.5,
                label=f"original vs {v}")
    ax.axvline(t, color="black", linewidth=1, label=f"threshold {t:.3f}")
    ax.set_xlabel("cosine of the whole-frame fragments")
    ax.set_ylabel("density")
    ax.set_title("near-duplicates on Flickr8K dev (test half)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
