"""Photos at the sizes and shapes people have them, made at run time from a shapes picture (upscaled): 12 MP in
both orientations and both common shapes (4:3, 3:2), 16:9, 24 and 48 MP, a 12,000 x 3,000 panorama, a 64 x 64
icon, a photo stored sideways with its EXIF orientation, a 12 MP HEIC and a 12 MP PNG. Each is indexed on every
path a photo takes (`fragsearch index`, the served folder's watcher, `POST /images`, `POST /annotate`,
`/search/similar` with an upload, the bulk indexer), every box it is given lies inside its picture, and the
whole-image fragment of a large copy reads as the small original does.

A picture larger than the reading side (ImageConfig.decode_side) is decoded at a reduced size and read at that
side; its boxes move between the decoded copy, the working image and the picture itself
(model/image.py ``rescale_boxes``), where float32 rounding once put a side past the picture's edge and every
12 MP JPEG was refused ("box can't exceed original image size").
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pillow_heif
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from fragsearch.index import ImageIndex, IndexSettings, list_images
from fragsearch.index.bulk import bulk_extract
from fragsearch.index.shards import read_shard, shard_files
from fragsearch.index.sync import open_index, sync_folder
from fragsearch.model.config import ImageConfig
from fragsearch.model.image import RegionExtractor
from fragsearch.model.imageio import read_image
from fragsearch.service.app import create_app
from fragsearch.service.engine import Engine
from tests.conftest import ShapesModel
from tests.conftest_service import API_KEY, engine_over_dev, make_settings

pillow_heif.register_heif_opener()

ROOT = Path(__file__).resolve().parent.parent
WATCH_BOUND = 300.0  # seconds for the watcher to index the folder on a busy machine (a bound, not a speed)
# The whole-image fragment of a large copy against the small original's: the cosine of their features, at
# least this for each region feature mode. Measured (AVX-512 EPYC): roi_align 0.9988-0.9996 for every 12, 24
# and 48 MP copy, 0.9959 for the 12,000 x 3,000 panorama; crop (the image warped to 224 px from the 1,024 px
# working image, against the 224 px original) 0.9686-0.9706, the panorama 0.9641. The bounds keep a margin
# under those that no instruction set's arithmetic comes near.
AGREEMENT = {"roi_align": 0.99, "crop": 0.95}


@dataclass(frozen=True)
class Shape:
    name: str  # the file's name
    width: int  # upright, as people see it
    height: int
    sideways: bool = False  # stored turned, with the EXIF orientation that turns it upright


SHAPES = [
    Shape("12mp-4x3.jpg", 4032, 3024),
    Shape("12mp-3x4.jpg", 3024, 4032),
    Shape("12mp-4000x3000.jpg", 4000, 3000),
    Shape("12mp-3000x4000.jpg", 3000, 4000),
    Shape("12mp-3x2.jpg", 4240, 2832),
    Shape("12mp-2x3.jpg", 2832, 4240),
    Shape("12mp-16x9.jpg", 4608, 2592),
    Shape("24mp-3x2.jpg", 6000, 4000),
    Shape("48mp-4x3.jpg", 8000, 6000),
    Shape("panorama.jpg", 12000, 3000),
    Shape("icon.png", 64, 64),
    Shape("12mp-sideways.jpg", 4032, 3024, sideways=True),
    Shape("12mp.heic", 4032, 3024),
    Shape("12mp.png", 4032, 3024),
]
SIZES = {s.name: (s.width, s.height) for s in SHAPES}


def encode(img: Image.Image, shape: Shape) -> bytes:
    """`img` (already at the shape's upright size) as the shape's file."""
    buf = io.BytesIO()
    suffix = Path(shape.name).suffix
    if shape.sideways:
        exif = Image.Exif()
        exif[0x0112] = 6  # turn 90 degrees clockwise to be upright
        img.transpose(Image.Transpose.ROTATE_90).save(buf, "JPEG", quality=85, exif=exif)
    elif suffix == ".heic":
        img.save(buf, "HEIF", quality=50, enc_params={"preset": "ultrafast"})
    elif suffix == ".png":
        img.save(buf, "PNG", compress_level=1)
    else:
        img.save(buf, "JPEG", quality=85)
    return buf.getvalue()


@dataclass
class RealPhotos:
    folder: Path  # every shape's file
    original: Path  # the small picture they are made from

    def files(self) -> Iterator[tuple[Shape, Path]]:
        for shape in SHAPES:
            yield shape, self.folder / shape.name


@pytest.fixture(scope="module")
def real_photos(shapes_model: ShapesModel, tmp_path_factory: pytest.TempPathFactory) -> RealPhotos:
    original = shapes_model.data / "images" / shapes_model.dev.names[0]
    small = Image.open(original).convert("RGB")
    folder = tmp_path_factory.mktemp("real-photos") / "Pictures"
    folder.mkdir()
    for shape in SHAPES:
        big = small.resize((shape.width, shape.height), Image.Resampling.BILINEAR)
        (folder / shape.name).write_bytes(encode(big, shape))
    with Image.open(folder / "12mp.heic") as heic:
        assert heic.format == "HEIF"  # really a HEIC, not a JPEG by another name
    return RealPhotos(folder, original)


def assert_inside(boxes: Iterable[Iterable[float]], width: int, height: int, what: str) -> None:
    """Every box [x0, y0, x1, y1] lies inside a picture of width x height, and is not inverted."""
    b = np.asarray(list(boxes), np.float64).reshape(-1, 4)
    assert len(b), f"{what}: no boxes"
    inside = (b[:, 0] >= 0) & (b[:, 1] >= 0) & (b[:, 2] <= width) & (b[:, 3] <= height)
    ordered = (b[:, 0] <= b[:, 2]) & (b[:, 1] <= b[:, 3])
    assert inside.all() and ordered.all(), f"{what}: boxes outside its {width}x{height}: {b[~(inside & ordered)]}"


def assert_indexed(index: ImageIndex, what: str) -> None:
    """`index` holds every shape once, at its upright size, every box inside its picture."""
    records = [r for r in (index.get(int(i)) for i in index.ids()) if r is not None]
    sizes = {r.name: (r.width, r.height) for r in records}
    assert sizes == SIZES, f"{what}: indexed {sizes}"
    for r in records:
        assert_inside(r.boxes, r.width, r.height, f"{what}: {r.name}")


def test_fragsearch_index_takes_every_photo_people_have(real_photos: RealPhotos, tmp_path: Path) -> None:
    """The command a person runs on their folder, with the released model (its crop features: the path that
    refused every 12 MP JPEG)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAGSEARCH_")}
    env.update(HOME=str(tmp_path / "home"), FRAGSEARCH_ARTIFACTS=str(tmp_path / "artifacts"))
    r = subprocess.run([sys.executable, "-m", "fragsearch", "index", str(real_photos.folder), "--workers", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"{len(SHAPES)} added" in out and "0 unreadable" in out, out[-3000:]
    from fragsearch.model.bundle import Bundle
    from fragsearch.model.release import RELEASED_MODEL

    manifest = next((tmp_path / "artifacts").rglob("sync-manifest.json"))
    index = ImageIndex.load(manifest.parent, Bundle.load(RELEASED_MODEL), collection_root=real_photos.folder)
    try:
        assert_indexed(index, "fragsearch index")
    finally:
        index.close()


def test_the_served_folders_watcher_takes_every_photo_people_have(shapes_model: ShapesModel,
                                                                   real_photos: RealPhotos, tmp_path: Path) -> None:
    """Photos copied into a served folder (a camera import) are indexed by the watcher's sync."""
    photos = tmp_path / "Pictures"
    photos.mkdir()
    settings = make_settings(shapes_model, tmp_path, collection=photos, image_index=tmp_path / "index",
                             watch_debounce_ms=200, watch_rescan=3600.0, max_pixels=50_000_000)
    index = open_index(settings.image_index, shapes_model.bundle, photos, settings.cache, IndexSettings())
    sync_folder(index, photos)  # what the start-up does (nothing there yet)
    engine = Engine(settings, shapes_model.bundle, index, None)
    with TestClient(create_app(settings, engine=engine)) as c:
        for _, path in real_photos.files():
            shutil.copy(path, photos / path.name)
        deadline = time.monotonic() + WATCH_BOUND
        while (ready := c.get("/readyz").json())["images"] < len(SHAPES) or ready["watch"]["backlog"]:
            assert ready["watch"]["last_error"] is None, ready["watch"]
            assert time.monotonic() < deadline, f"not indexed within {WATCH_BOUND:.0f} s: {ready}"
            time.sleep(0.2)
        report = ready["watch"]["last_report"]  # the sync's summary line
        assert "0 unreadable" in report, report
        assert_indexed(engine.images, "the watcher")


@pytest.fixture
def uploads(shapes_model: ShapesModel, tmp_path: Path) -> Iterator[tuple[TestClient, Engine]]:
    """A writable app over the shapes dev images and training captions that takes uploads of any size a camera
    makes (the suite's apps keep small limits)."""
    engine = engine_over_dev(shapes_model, shapes_model.bundle, tmp_path, max_upload_bytes=64_000_000,
                             max_pixels=50_000_000)
    with TestClient(create_app(engine.settings, engine=engine)) as c:
        yield c, engine


def alignment_boxes(results: list[dict[str, Any]]) -> list[list[float]]:
    return [a["box"] for r in results for a in r["alignment"] if a["box"] is not None]  # null: not found


def test_uploads_of_every_photo_people_have_are_added_annotated_and_searched_with(
        uploads: tuple[TestClient, Engine], real_photos: RealPhotos) -> None:
    c, engine = uploads
    for shape, path in real_photos.files():
        data = path.read_bytes()
        added = c.post("/images", files={"file": (shape.name, data)}, headers={"X-API-Key": API_KEY})
        assert added.status_code == 201, f"{shape.name}: {added.text}"
        body = added.json()
        assert (body["width"], body["height"]) == (shape.width, shape.height), shape.name
        record = engine.images.get(body["id"])
        assert record is not None
        assert_inside(record.boxes, shape.width, shape.height, f"POST /images {shape.name}")

        annotated = c.post("/annotate", files={"file": (shape.name, data)}, data={"k": "5"})
        assert annotated.status_code == 200, f"{shape.name}: {annotated.text}"
        body = annotated.json()
        assert (body["width"], body["height"]) == (shape.width, shape.height) and body["results"], shape.name
        assert_inside(alignment_boxes(body["results"]), shape.width, shape.height, f"/annotate {shape.name}")

        similar = c.post("/search/similar", files={"file": (shape.name, data)}, data={"k": "3"})
        assert similar.status_code == 200, f"{shape.name}: {similar.text}"
        body = similar.json()
        assert (body["width"], body["height"]) == (shape.width, shape.height) and body["results"], shape.name
        assert_inside(alignment_boxes(body["described_by"]), shape.width, shape.height, f"/search/similar {shape.name}")


def test_the_bulk_indexer_extracts_every_photo_people_have(real_photos: RealPhotos, tmp_path: Path) -> None:
    """The bulk indexer's local engine, with crop features (the released model's)."""
    cfg = ImageConfig(region_features="crop")
    report = bulk_extract(list_images(real_photos.folder), tmp_path / "shards", cfg, "local", workers=1,
                          progress=False)
    assert (report.extracted, report.failed) == (len(SHAPES), 0), report
    seen: dict[str, tuple[int, int]] = {}
    for f in shard_files(tmp_path / "shards"):
        shard = read_shard(f)
        for name, (width, height), boxes in zip(shard.names, shard.sizes.tolist(), shard.boxes, strict=True):
            seen[name] = (width, height)
            assert_inside(boxes, width, height, f"bulk {name}")
    assert seen == SIZES


@pytest.mark.parametrize("features", ["roi_align", "crop"])
def test_a_large_copy_reads_as_its_small_original(real_photos: RealPhotos, features: str) -> None:
    """The whole-image fragment of each copy, read at the reading side, against the original's."""
    extractor = RegionExtractor(ImageConfig(region_features=features))
    original = extractor.extract(read_image(real_photos.original)).features[0]
    for shape, path in real_photos.files():
        if shape.name == "icon.png":
            continue  # smaller than the original: nothing to agree with
        frag = extractor.extract(read_image(path, side=extractor.cfg.decode_side))
        assert (frag.width, frag.height) == (shape.width, shape.height)
        assert_inside(frag.boxes, frag.width, frag.height, shape.name)
        whole = frag.features[0]
        cosine = float(whole @ original / (np.linalg.norm(whole) * np.linalg.norm(original)))
        assert cosine >= AGREEMENT[features], f"{shape.name}: whole image at cosine {cosine:.4f} with the original"
