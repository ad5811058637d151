"""Grounding on dev: does the region an alignment draws for a phrase hold the thing the phrase names, by
Flickr30k Entities' boxes (model/entities.py)?

    python -m bench.grounding --out docs/results/grounding-dev.csv --types-out docs/results/grounding-dev-types.csv \
        --plot docs/results/grounding-dev.png
    python -m bench.grounding --model artifacts/models/NAME/model.pt --merge   # another model's row beside it

Every dev caption is aligned with its own image by the service's code (index/matches.py ``matches``: what
``/explain`` and every result's ``alignment`` return), on the model's fragments of the Flickr8K copy (224 px,
the feature cache's extraction). Each caption is matched to its Entities line; each phrase with a box (not
``notvisual``) is scored against its chain's boxes, scaled to the copy, by the standard measures:
accuracy @ IoU 0.5 (the answer's box overlaps one of the phrase's boxes at IoU >= 0.5), pointing (the box's
centre lies in one of them) and the mean of the best IoU.

Two units:
- ``phrase``: one answer per phrase: the region drawn for the aligned triplet that names the phrase's head noun
  (its last word, as model/grounder.py ``named_by`` reads a triplet: ``det(dog, a)``, ``nsubj(runs, dog)``)
  with the best score; else for the one that holds the head with the best score; else for the best-scoring
  aligned triplet holding any word of the phrase; a phrase no aligned triplet touches has no answer and counts
  as a miss (``answered`` says how many had one). With the model's grounder (the service's answer) every
  triplet that names a thing draws the thing's region, and the box drawn is its region's fused with the regions
  around it (model/grounder.py ``fused_box``); ``--unfused`` measures the region's own box, ``--alignment-only``
  the alignment's own choice (each triplet's best-scoring region) on the same model.
- ``pair``: every aligned triplet with every phrase one of its words falls in (a triplet whose two words lie in
  two phrases counts for each): the measure taken from outside on the test images.

Beside each, on the same phrases or pairs: the whole image as the answer, a fragment of the image drawn at
random (its expectation over the image's fragments, so no draw is made) and the best of the image's own
fragments (what its regions allow: the upper bound of any choice among them). Per entity type in
``--types-out``. Rows carry the model, the machine, its CPU flags and the command.
"""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench import kept_rows, machine, parse_run, write_rows
from bench.photo_decode import cpu_flags
from fragsearch.index.matches import SentenceReading, aligned, read_sentence
from fragsearch.index.types import FragmentMatch
from fragsearch.model.boxes import box_iou
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import load_split_data
from fragsearch.model.embed import embed_texts
from fragsearch.model.entities import Phrase, read_entities
from fragsearch.model.evidence import thing_members
from fragsearch.model.grounder import named_by
from fragsearch.model.parsers import make_parser
from fragsearch.model.release import RELEASE_DIR, RELEASED_MODEL, read_manifest
from fragsearch.model.text import Triplet
from fragsearch.settings import default_cache_dir, default_data_dir

logger = logging.getLogger("bench.grounding")
IOU = 0.5
BATCH = 256  # captions embedded at a time


@dataclass
class Tally:
    """Hits of the answers and of the baselines over a set of phrases (or pairs)."""

    n: int = 0
    answered: int = 0
    hit: float = 0.0
    pointed: float = 0.0
    iou: float = 0.0
    whole: float = 0.0
    random: float = 0.0
    upper: float = 0.0

    def add(self, answer: Sequence[float] | None, truth: np.ndarray, fragments: np.ndarray) -> None:
        """One phrase: the answer's box (None: no answer), its true boxes (K, 4), the image's fragments (F, 4),
        row 0 the whole image."""
        self.n += 1
        per_fragment = box_iou(fragments, truth).max(axis=1)  # (F,) each fragment's best IoU with the truth
        hits = per_fragment >= IOU
        self.whole += float(hits[0])
        self.random += float(hits.mean())
        self.upper += float(hits.any())
        if answer is None:
            return
        self.answered += 1
        box = np.asarray(answer, np.float32).reshape(1, 4)
        best = float(box_iou(box, truth).max())
        self.iou += best
        self.hit += float(best >= IOU)
        cx, cy = (box[0, 0] + box[0, 2]) / 2, (box[0, 1] + box[0, 3]) / 2
        self.pointed += float(((truth[:, 0] <= cx) & (cx <= truth[:, 2]) & (truth[:, 1] <= cy)
                               & (cy <= truth[:, 3])).any())

    def row(self) -> dict[str, Any]:
        n = max(self.n, 1)
        return {"phrases": self.n, "answered": round(100 * self.answered / n, 1),
                "accuracy": round(100 * self.hit / n, 1), "pointing": round(100 * self.pointed / n, 1),
                "mean_iou": round(self.iou / n, 3), "whole_image": round(100 * self.whole / n, 1),
                "random_fragment": round(100 * self.random / n, 1), "upper_bound": round(100 * self.upper / n, 1)}


@dataclass
class Grounding:
    """Tallies of one model: per unit (phrase, pair), overall and per entity type; examples for the plot."""

    tallies: dict[tuple[str, str], Tally] = field(default_factory=lambda: defaultdict(Tally))
    examples: list[dict[str, Any]] = field(default_factory=list)
    captions: int = 0
    matched: int = 0

    def add(self, unit: str, types: Sequence[str], answer: Sequence[float] | None, truth: np.ndarray,
            fragments: np.ndarray) -> None:
        for kind in ("all", *types):
            self.tallies[(unit, kind)].add(answer, truth, fragments)


def phrase_answer(phrase: Phrase, alignment: Sequence[FragmentMatch], things: Sequence[str]
                  ) -> FragmentMatch | None:
    """A phrase's answer among a caption's aligned triplets (see the module's note); `things`: the things the
    caption's triplets name."""
    def best(found: list[FragmentMatch]) -> FragmentMatch | None:
        return max(found, key=lambda m: (m.score, -m.fragment)) if found else None

    words = set(phrase.words)
    return (best([m for m in alignment
                  if named_by(Triplet(m.relation, m.words[0], m.words[1]), things) == phrase.head])
            or best([m for m in alignment if phrase.head in m.words])
            or best([m for m in alignment if words & set(m.words)]))


def ground(bundle: Bundle, data: Path, entities: Path, cache: Path, workers: int, limit: int | None,
           examples: int, grounded: bool = True) -> Grounding:
    """Every dev caption aligned with its own image and scored against the Entities boxes (`grounded`: with the
    model's grounder, as the service draws it; else the alignment's own regions)."""
    dev = load_split_data(data, "dev", bundle.image_cfg, cache, make_parser(bundle.text.cfg.parser),
                          workers=workers, limit=limit, device="cpu")
    ents = read_entities(entities, dev.names)
    logger.info("%d dev images, %d with Entities annotations, %d captions", len(dev.names), len(ents),
                len(dev.sentences))
    vectors = np.concatenate([bundle.embed_images(dev.feats[k : k + 256]) for k in range(0, len(dev.names), 256)])
    out = Grounding()
    for start in tqdm(range(0, len(dev.sentences), BATCH), desc="captions", unit="batch"):
        texts = dev.sentences[start : start + BATCH]
        for offset, (sent, triplets) in enumerate(embed_texts(bundle, texts, strict=False)):
            l = start + offset  # noqa: E741
            k = int(dev.pair_image[l])
            out.captions += 1
            name = dev.names[k]
            image = ents.get(name)
            caption = image.match(texts[offset]) if image is not None else None
            if image is None or caption is None or not len(sent):
                continue
            out.matched += 1
            fragments = dev.boxes[k]
            width, height = int(round(float(fragments[0, 2]))), int(round(float(fragments[0, 3])))
            reading = read_sentence(bundle, sent, triplets)
            if not grounded:
                reading = SentenceReading(reading.evidence)
            alignment, _ = aligned(vectors[k], sent, triplets, fragments, bundle.blocks, (), reading)
            things = thing_members(triplets)[0]
            drawn = len(out.examples) >= examples or l % 97 != 0  # one phrase of every 97th caption is drawn
            for phrase in image.boxed(caption):
                truth = image.boxes_at(phrase.chain, width, height)
                answer = phrase_answer(phrase, alignment, things)
                out.add("phrase", phrase.types, None if answer is None else answer.box, truth, fragments)
                for m in alignment:
                    if set(phrase.words) & set(m.words):
                        out.add("pair", phrase.types, m.box, truth, fragments)
                if answer is not None and not drawn:
                    drawn = True
                    out.examples.append({"image": name, "caption": texts[offset], "phrase": phrase.text,
                                         "triplet": answer.triplet, "answer": answer.box,
                                         "truth": truth.tolist(), "size": (width, height)})
    return out


def plot(examples: list[dict[str, Any]], path: Path) -> None:
    """Each example's returned box (red) against the phrase's true boxes (green), drawn on the image's frame
    (the photos themselves are not drawn: nothing of the data set's pixels goes into the results)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cols = 4
    rows = max(1, (len(examples) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 4.4 * rows), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for ax, ex in zip(axes.ravel(), examples, strict=False):
        w, h = ex["size"]
        ax.set_xlim(0, w)
        ax.set_ylim(h, 0)
        ax.set_aspect("equal")
        ax.add_patch(Rectangle((0, 0), w, h, fill=True, color="#f2f2f2"))
        for b in ex["truth"]:
            ax.add_patch(Rectangle((b[0], b[1]), b[2] - b[0], b[3] - b[1], fill=False, color="green", lw=2))
        a = ex["answer"]
        ax.add_patch(Rectangle((a[0], a[1]), a[2] - a[0], a[3] - a[1], fill=False, color="red", lw=2, ls="--"))
        ax.set_title(f"\"{ex['phrase']}\" → {ex['triplet']}\n{ex['image']}", fontsize=8)
    fig.suptitle("dev: the phrase's Entities boxes (green) and the box the service draws for it (red, dashed)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    logger.info("wrote %s", path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=RELEASED_MODEL, help="the model (default: the released one)")
    ap.add_argument("--name", default=None, help="the row's model cell (default: 'released <row>' or the folder)")
    ap.add_argument("--data", type=Path, default=default_data_dir(), help="the Flickr8K folder")
    ap.add_argument("--entities", type=Path, default=None,
                    help="the Flickr30k Entities folder (default: flickr30k-entities beside the Flickr8K folder)")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="the feature and parse cache")
    ap.add_argument("--workers", type=int, default=2, help="extraction processes for dev images not cached")
    ap.add_argument("--limit", type=int, default=None, help="only the first N dev images (a trial)")
    ap.add_argument("--examples", type=int, default=8, help="examples drawn in --plot")
    ap.add_argument("--out", type=Path, default=Path("docs/results/grounding-dev.csv"),
                    help="the results CSV, a row per model")
    ap.add_argument("--types-out", type=Path, default=Path("docs/results/grounding-dev-types.csv"),
                    help="the results CSV per entity type, a row per model and type")
    ap.add_argument("--plot", type=Path, default=None, help="a PNG of examples (boxes only)")
    ap.add_argument("--merge", action="store_true", help="keep the rows of other models already in the results")
    ap.add_argument("--alignment-only", action="store_true",
                    help="draw each triplet's best-scoring region, not the grounder's (the row is named so)")
    ap.add_argument("--unfused", action="store_true",
                    help="draw the grounder's best region's own box, not the box fused with the regions around it "
                         "(model/grounder.py fused_box; the row is named so)")
    ap.add_argument("--unrefined", action="store_true",
                    help="fuse the regions' own boxes, not the boxes the grounder's refiner moved, at the fusion "
                         "chosen before the refiner (model/grounder.py Refiner; the row is named so)")
    args, command = parse_run(ap, argv, "bench.grounding")
    entities = args.entities or args.data.parent / "flickr30k-entities"
    bundle = Bundle.load(args.model)
    released = Path(args.model).resolve() == Path(RELEASED_MODEL).resolve()
    name = args.name or (f"released {read_manifest(RELEASE_DIR).get('row', '')}".strip() if released
                         else Path(args.model).parent.name)
    grounded = bundle.grounder is not None and not args.alignment_only
    if bundle.grounder is not None and args.alignment_only:
        name += ", alignment only"
    elif bundle.grounder is not None and args.unfused:
        g = bundle.grounder
        bundle.grounder = replace(g, refiner=None, state={**g.state, "fusion": {"temperature": 0.0, "overlap": 1.0}})
        name += ", best region's box"
    elif bundle.grounder is not None and args.unrefined:
        g = bundle.grounder
        before = g.state.get("refiner", {}).get("fusion_before")
        bundle.grounder = replace(g, refiner=None, state={**g.state, "fusion": before} if before else
                                  {k: v for k, v in g.state.items() if k != "fusion"})
        name += ", boxes not refined"
    result = ground(bundle, args.data, entities, args.cache, args.workers, args.limit, args.examples, grounded)
    logger.info("%d of %d captions matched to their Entities line", result.matched, result.captions)
    stamp = {"machine": machine(), "cpu_flags": cpu_flags(), "command": command}
    phrase, pair = result.tallies[("phrase", "all")].row(), result.tallies[("pair", "all")].row()
    row = {"model": name, **phrase, "pairs": pair["phrases"], "pair_accuracy": pair["accuracy"],
           "pair_pointing": pair["pointing"], "pair_mean_iou": pair["mean_iou"],
           "pair_whole_image": pair["whole_image"], "pair_random_fragment": pair["random_fragment"],
           "pair_upper_bound": pair["upper_bound"], "captions": result.captions, "matched": result.matched, **stamp}
    rows: list[dict[str, Any]] = [*kept_rows(args.out, args.merge, [name]), row]
    write_rows(args.out, list(row), rows)
    types = sorted({kind for unit, kind in result.tallies if kind != "all"})
    type_rows = [{"model": name, "unit": unit, "type": kind, **result.tallies[(unit, kind)].row()}
                 for unit in ("phrase", "pair") for kind in ("all", *types) if (unit, kind) in result.tallies]
    kept: list[dict[str, Any]] = [*kept_rows(args.types_out, args.merge, [name]), *type_rows]
    write_rows(args.types_out, list(type_rows[0]), kept)
    for r in type_rows:
        logger.info("%s", r)
    if args.plot is not None and result.examples:
        plot(result.examples, args.plot)


if __name__ == "__main__":
    main()
