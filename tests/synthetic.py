"""A small data folder the tests make themselves: pictures of coloured shapes with captions.

Each picture holds two shapes of different colours and kinds at random places; its five captions
name both ("a red circle beside a blue square"), so the fragments are unambiguous.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60), "yellow": (240, 210, 20)}
SHAPES = ("circle", "square", "triangle")
TEMPLATES = (
    "a {c1} {s1} beside a {c2} {s2} .",
    "A {c1} {s1} and a {c2} {s2} .",
    "There is a {c2} {s2} next to a {c1} {s1} .",
    "A picture of a {c1} {s1} near a {c2} {s2}",
    "the {c2} {s2} is close to the {c1} {s1} .",
)


def draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], rgb: tuple[int, int, int]
) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=rgb)


def make_picture(rng: random.Random, size: int = 224) -> tuple[Image.Image, list[dict[str, object]]]:
    img = Image.new("RGB", (size, size), (245, 245, 245))
    draw = ImageDraw.Draw(img)
    c1, c2 = rng.sample(sorted(COLOURS), 2)
    s1, s2 = rng.sample(SHAPES, 2)
    side = size // 3
    # left/right halves, random vertical position
    objs = []
    for (colour, shape), half in zip(((c1, s1), (c2, s2)), rng.sample([0, 1], 2), strict=True):
        x0 = rng.randint(half * size // 2 + 4, half * size // 2 + size // 2 - side - 4)
        y0 = rng.randint(4, size - side - 4)
        box = (x0, y0, x0 + side, y0 + side)
        draw_shape(draw, shape, box, COLOURS[colour])
        objs.append({"colour": colour, "shape": shape, "box": list(box)})
    return img, objs


def make_dataset(root: Path, n_train: int = 60, n_dev: int = 20, seed: int = 0) -> dict[str, list[dict[str, object]]]:
    """Writes root/images/*.jpg, captions.txt, train.txt, dev.txt and objects.json; returns the objects."""
    rng = random.Random(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    objects: dict[str, list[dict[str, object]]] = {}
    lines: list[str] = []
    names: list[str] = []
    for i in range(n_train + n_dev):
        img, objs = make_picture(rng)
        name = f"shape_{i:04d}.jpg"
        img.save(root / "images" / name, quality=95)
        objects[name] = objs
        names.append(name)
        a, b = objs
        for j, t in enumerate(TEMPLATES):
            lines.append(f"{name}#{j}\t" + t.format(c1=a["colour"], s1=a["shape"], c2=b["colour"], s2=b["shape"]))
    (root / "captions.txt").write_text("\n".join(lines) + "\n")
    (root / "train.txt").write_text("\n".join(names[:n_train]) + "\n")
    (root / "dev.txt").write_text("\n".join(names[n_train:]) + "\n")
    (root / "objects.json").write_text(json.dumps(objects))
    return objects


def iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def points_at(box: list[float], target: list[float], other: list[float]) -> bool:
    """The box lies mostly on the target shape's box (>= half its area) and its centre is not on the other's."""
    ix = max(0.0, min(box[2], target[2]) - max(box[0], target[0]))
    iy = max(0.0, min(box[3], target[3]) - max(box[1], target[1]))
    area = max((box[2] - box[0]) * (box[3] - box[1]), 1e-9)
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    on_other = other[0] <= cx <= other[2] and other[1] <= cy <= other[3]
    return ix * iy / area >= 0.5 and not on_other
