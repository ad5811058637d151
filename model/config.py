"""Settings for the offline pipeline, grouped by concern (small dataclasses, no module globals).

The paper's constants live here as named defaults: 19 + 1 image fragments, smoothing n = 5,
the 1 % relation cut-off.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def collection_index(artifacts: Path, folder: Path) -> Path:
    """The index folder of a photo collection: <artifacts>/index/collection-<folder name>-<hash of its
    absolute path> (two folders of one name get their own)."""
    folder = Path(folder).resolve()
    tag = hashlib.sha256(str(folder).encode()).hexdigest()[:8]
    return Path(artifacts) / "index" / f"collection-{folder.name or 'root'}-{tag}"


def described(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A settings field with what its command-line flag says: its help and, for a word, the words it takes (the
    commands make their flags from the fields: fragsearch/commands/flags.py)."""
    return field(default=default, metadata={"help": help, "choices": choices})


REGION_FEATURES = ("roi_align", "crop")
PROPOSAL_MODES = ("single", "balanced", "fast", "quality")
PROPOSAL_SOURCES = ("selective_search", "detector", "detector_topup")
BACKBONE_PRECISIONS = ("fp32", "int8")
BACKBONE_NAMES = ("efficientnet-lite0", "efficientnet-lite1", "efficientnet-lite2")


@dataclass(frozen=True)
class ImageConfig:
    """How images become fragments."""

    n_regions: int = 19  # detected regions kept beside the whole image (paper: 19)
    region_features: str = described("roi_align", "roi_align: pooled from one backbone pass; crop: a backbone pass "
                                     "per region", REGION_FEATURES)
    backbone_size: int = described(448, "side of the one backbone pass (roi_align features; proposal scoring with "
                                   "crops)")
    crop_size: int = described(224, "side regions are warped to with --region-features crop")
    # the int8 graph: the quantized ONNX graph (model/backbone.py)
    backbone_precision: str = described("fp32", "fp32, or int8: the quantized backbone graph", BACKBONE_PRECISIONS)
    # selective search: "single", "balanced", "fast" or "quality" (model/image.py); "balanced" is
    # OpenCV's fast mode minus its coarsest k and its colour-blind strategy: 0.6x the time, nearly
    # the same regions (docs/results/extract-bench.csv)
    proposal_mode: str = described("balanced", "selective search strategy set", PROPOSAL_MODES)
    proposal_resize: int = described(224, "longer side the image is resized to for selective search")
    max_proposals: int = 300  # proposals scored by the backbone before NMS
    min_box_frac: float = described(0.04, "smallest region side as a fraction of the image side")
    nms_iou: float = 0.5
    full_frame_only: bool = False  # ablation: one fragment per image
    # a fine-tuned backbone: a state_dict file of the whole EfficientNet-Lite0 (path relative to the
    # artifacts folder, or absolute); "" = the ImageNet weights. The feature cache key carries the digest
    # of the file's bytes, so features of two weights never mix. Proposals are still ranked by ImageNet.
    backbone_weights: str = ""
    # the fragments' features: "efficientnet-lite0" (the served default), or the larger "efficientnet-lite1" /
    # "efficientnet-lite2" (their weight packages installed beside the environment, model/backbone.py), run at
    # crop_size (their native sides: 240 / 260). Crop features only; proposals stay ranked by Lite0. In the
    # feature cache key.
    backbone: str = described("efficientnet-lite0", "the fragments' CNN (crop features; --crop-size its native side: "
                              "240 / 260)", BACKBONE_NAMES)
    # a training view (TrainConfig.mirror_views): every crop, and the whole image, mirrored left to right before
    # the backbone; the boxes are those of the image as it is (the same proposals and ranking). Crop features
    # only; in the feature cache key when set. Never a served model's setting.
    mirror: bool = False
    # where regions come from: "selective_search" (ranked by the ImageNet Lite0, the default), "detector" (the
    # COCO detector's boxes, model/detector.py; best first, class-agnostic NMS) or "detector_topup" (the
    # detections scoring at least detector_floor, the free slots filled from selective search). In the feature
    # cache key when not the default.
    proposals: str = described("selective_search", "regions from selective search, the COCO detector, or the detector "
                               "topped up with selective search", PROPOSAL_SOURCES)
    detector_floor: float = described(0.3, "with --proposals detector_topup: the smallest detection score kept as a "
                                      "region")
    # the detector's knowledge as a channel: each fragment's feature is its CNN feature followed by the COCO
    # detector's 90 class scores for its box (zeros for a box the detector did not propose; the whole image's
    # row the largest score of each class over its detected regions), a learned input of the image encoder.
    # Needs detector proposals; in the feature cache key when set.
    detector_classes: bool = described(False, "with detector proposals: each fragment's features carry the detector's "
                                       "class scores")
    # a picture whose longer side exceeds this is read at this side (model/image.py working_image; a JPEG is
    # also decoded at a reduced size, model/imageio.py read_image): proposals and features see at most 448 px
    # of it, so a camera's 12 to 48 MP only cost time. Boxes stay in the picture's own pixels. 0: every picture
    # at its own size. Not in the cache folder's key: an entry of a larger picture is keyed by its bytes and
    # this side (model/features.py content_key), so the entries of pictures within it stay as they were.
    decode_side: int = 1024
    # the proposals' order: "" ranks them by the ImageNet head's confidence (an objectness proxy); a region
    # ranker's file name (model/regions.py, ``region-ranker-<digest>.npz``, trained on the training images'
    # Entities boxes by training/regions.py) ranks them by how likely each is a box someone named. Selective
    # search's proposals only; in the feature cache key when set.
    region_ranker: str = described("", "the region ranker's file name (region-ranker-<digest>.npz, "
                                   "training/regions.py) that orders selective search's proposals; empty: the ImageNet "
                                   "head's objectness")
    # with a region ranker, the regions split between two choosers: the first ``head_regions`` are the ImageNet
    # head's (its confidence, among the proposals with sides of at least ``head_min_box_frac``: the regions a
    # model without a ranker keeps first), the others the ranker's among every proposal (sides of at least
    # ``min_box_frac``), by NMS against the head's too. 0: every region the ranker's. In the feature cache key
    # when set.
    head_regions: int = described(0, "with --region-ranker: how many of the regions the ImageNet head chooses "
                                  "first (among boxes with sides of at least --head-min-box-frac); the ranker "
                                  "chooses the rest")
    head_min_box_frac: float = described(0.25, "with --head-regions: the smallest side of the head's regions, as a "
                                         "fraction of the image's")

    @property
    def n_fragments(self) -> int:
        return 1 if self.full_frame_only else 1 + self.n_regions


# ImageConfig's fields added after feature caches and indexes were made: the feature cache's folder key
# (model/features.py `config_payload`: each out of the image settings it hashes, in a form of its own where set; the
# backbone always, beside them) and an index's model fingerprint (index/fingerprint.py: each left out at its
# default) keep the names of the caches and indexes of a model that does not use them (the crops' CNN, the mirrored
# training view, the source of the regions and its floor, the detector's class scores beside the features, the side
# large pictures are read at, the region ranker and the regions it shares with the ImageNet head). A field added
# later joins this list.
IMAGE_FIELDS_ADDED_LATER = ("backbone", "mirror", "proposals", "detector_floor", "detector_classes", "decode_side",
                            "region_ranker", "head_regions", "head_min_box_frac")


SENTENCE_PASSES = ("text", "words")


@dataclass(frozen=True)
class TextConfig:
    """How sentences become fragments."""

    parser: str = "spacy"  # "spacy" or "stanza"
    fragments: str = "dependency"  # "dependency", "bow", "bigram" or "tree" (the parse tree, for tree RNNs)
    relation_cutoff: float = 0.01  # relation types under this share of training relations are dropped
    min_word_count: int = 1  # training-vocabulary words seen fewer times are dropped
    sentence_fragment: bool = False  # add a whole-sentence fragment beside the triplets
    word_vectors: str = "static"  # "static" (per-word table) or "contextual" (tokens in their sentence)
    # where the whole-sentence fragment's MiniLM vector is read from, with contextual words: "text", a pass over the
    # caption's text (a second pass wherever the text tokenizes otherwise than its words, e.g. with punctuation: 9 in
    # 10 captions), or "words", the words' own pass (one pass a sentence, as a model with its own layers reads them)
    sentence_pass: str = "text"

    def __post_init__(self) -> None:
        if self.sentence_pass not in SENTENCE_PASSES:
            raise ValueError(f"text.sentence_pass must be one of {', '.join(SENTENCE_PASSES)}, "
                             f"got {self.sentence_pass!r}")
    unigram_prob: float = 0.05  # training: share of sentences shown as unigram fragments (trains fallback)
    max_words: int = 64  # longest caption parsed (tokens past it are ignored)


SELECTIONS = ("val", "last")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and model-selection settings (each is a `python -m fragsearch.training.train` flag of the same
    name)."""

    objective: str = "full"  # full (C_0 -> C_F, + global), fragment+global (C_0 + global), fragment, global
    epochs: int = 10  # paper: 20 (half the budget fits a 2-core machine; the R-sum has flattened by then)
    dense_epochs: int = 4  # epochs with the dense C_0 before switching to MIL C_F (paper: half)
    anneal_epochs: int = 2  # last epochs at lr x 0.1
    batch_size: int = 100  # image-sentence pairs per batch
    optimizer: str = "adam"  # "adam" or "sgd" (momentum 0.9, as in the paper)
    lr: float = 1e-3
    text_lr: float = 2e-5  # a model's own top layers of MiniLM (ModelConfig.text_layers): their learning rate
    text_from: str = ""  # fragment models: a trained checkpoint whose own top layers of MiniLM this model reads,
    # fixed (copied into it, not trained): the members after the first of a run with text_layers; "" = none
    momentum: float = 0.9
    weight_decay: float = 1e-6  # alpha
    grad_clip: float = 0.0  # > 0: the gradient's global norm is clipped to this before each step (0 = off)
    beta: float = 1.0  # weight of the global ranking objective
    margin: float = 0.05  # Delta of C_G (S_kl are averages, so it is on their small scale)
    global_top_k: int = 0  # C_G over the k most violating negatives per pair and direction (0 = all, paper)
    max_violation_from: int = 0  # > 0: from this epoch on (1-based) C_G counts only each pair's hardest negative
    # in each direction (max violation), after global_top_k as a warm-up (0 = never)
    nce_scale: float = 0.0  # > 0: C_G is the contrastive (InfoNCE) loss over the batch's S_kl times this scale,
    # both directions, in place of the hinge (margin, global_top_k, max_violation_from then unused); 0 = the hinge
    mirror_views: float = 0.0  # training only: each training image of a batch is shown as its mirrored view
    # (ImageConfig.mirror: its crops flipped left to right, extracted once into their own cache) with this probability
    fragment_drop: float = 0.0  # training only: each image and sentence fragment is left out of a batch with this
    # probability (at least one kept per image and per sentence)
    box_supervision: bool = False  # fragment models: the training captions' phrases that Flickr30k Entities boxes
    # label their triplets' regions (+1 a fragment holding the box, -1 the image's others) in place of the MIL
    # labels (training/boxes.py); read from flickr30k-entities beside the data folder
    distill_from: str = ""  # fragment models: a trained model's checkpoint (a merged ensemble), or several separated
    # by commas (summed, each reading its own image features), whose batch S_kl are soft targets beside the
    # objectives (training/distill.py); "" = none
    distill_weight: float = 1.0  # weight of the distillation term (with distill_from)
    distill_scale: float = 3.0  # the standardised batch scores of student and teacher times this are the logits
    rank_images: bool = True  # DT-RNN / DeViSE: the ranking loss also ranks images for a sentence (False: DeViSE's)
    balanced: bool = True  # average positive and negative fragment hinges separately
    h: int = 256  # embedding size (paper: ~1000)
    calibrate: int = 0  # fragment models: reference images and sentences for score calibration (0 = none)
    # two-branch baseline
    tb_margin: float = 0.1
    tb_top_k: int = 50
    tb_lambda_img: float = 2.0
    tb_lambda_struct: float = 0.1
    # model selection: never on dev (dev is the split the results report)
    selection: str = "val"  # "val": the epoch with the best R-sum on the validation part; "last": the last epoch
    val_images: int = 500  # training images held out (with their captions) as the validation part
    val_seed: int = 0  # draw of the validation part (fixed: the same images in every run)
    eval_every: int = 2  # epochs between evaluations on the validation part (and the last epoch)
    seed: int = 0
    members: int = 1  # > 1: that many runs of these settings from seeds seed, seed + 1, ..., each selected alone,
    # merged into one checkpoint with each member's S_kl thresholded apart (training/merge.py): h = members x h
    device: str = "auto"  # auto (cuda when available) | cpu | cuda: model/device.py
