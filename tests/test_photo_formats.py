"""The photo formats phones and browsers make: HEIC/HEIF (pillow-heif) and AVIF (Pillow's plugin), written
by the tests, decoded by model.imageio, uploaded to the service, indexed by the folder sync and
thumbnailed, like JPEGs."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageDraw

from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.sync import sync_folder
from fragsearch.model.dataset import feature_cache
from fragsearch.model.imageio import IMAGE_SUFFIXES, ImageReadError, load_image
from fragsearch.service.thumbnails import thumbnail
from tests.conftest import exported

if TYPE_CHECKING:
    from tests.conftest import ShapesModel, exported
    from tests.conftest_service import ServiceEnv

pytest_plugins = ["tests.conftest_service"]

FORMATS = [("HEIF", ".heic"), ("HEIF", ".heif"), ("AVIF", ".avif")]


def picture(width: int = 96, height: int = 64) -> Image.Image:
    """Left half red, right half blue."""
    img = Image.new("RGB", (width, height), (220, 20, 20))
    ImageDraw.Draw(img).rectangle((width // 2, 0, width, height), fill=(20, 40, 220))
    return img


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, quality=90)
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).format == fmt  # really that format, not a JPEG by another name
    return data


@pytest.mark.parametrize(("fmt", "suffix"), FORMATS)
def test_load_image_decodes_the_photo_format(fmt: str, suffix: str, tmp_path: Path) -> None:
    assert suffix in IMAGE_SUFFIXES
    path = tmp_path / f"phone{suffix}"
    path.write_bytes(encoded(picture(), fmt))
    for source in (path, path.read_bytes()):
        img = load_image(source)
        assert img.mode == "RGB" and img.size == (96, 64)
        pixels = np.asarray(img, dtype=np.float32)
        assert np.abs(pixels[:, :40].mean(axis=(0, 1)) - (220, 20, 20)).max() < 25  # red stays red
        assert np.abs(pixels[:, 56:].mean(axis=(0, 1)) - (20, 40, 220)).max() < 25  # blue stays blue


def test_a_heic_photo_is_turned_upright_by_its_orientation(tmp_path: Path) -> None:
    """Phones store HEIC sideways with an orientation tag, as they do JPEGs."""
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    buf = io.BytesIO()
    picture(96, 64).save(buf, format="HEIF", exif=exif.tobytes())
    assert load_image(buf.getvalue()).size == (64, 96)


@pytest.mark.parametrize("suffix", [".heic", ".avif"])
def test_a_truncated_photo_is_a_read_error(suffix: str) -> None:
    data = encoded(picture(), "HEIF" if suffix == ".heic" else "AVIF")
    with pytest.raises(ImageReadError, match="phone"):
        load_image(data[: len(data) // 2], name="phone" + suffix)


@pytest.mark.parametrize(("fmt", "suffix"), FORMATS)
def test_thumbnail_of_the_photo_format(fmt: str, suffix: str, tmp_path: Path) -> None:
    source = tmp_path / f"phone{suffix}"
    source.write_bytes(encoded(picture(192, 128), fmt))
    out = thumbnail(source, 64, tmp_path / "thumbs", max_pixels=10**8)
    with Image.open(out) as thumb:
        assert thumb.format == "JPEG" and thumb.size == (64, 43)


def test_the_sync_indexes_heic_and_avif_photos(shapes_model: ShapesModel, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.heic").write_bytes(encoded(picture(), "HEIF"))
    (photos / "b.HEIF").write_bytes(encoded(picture(64, 96), "HEIF"))
    (photos / "c.avif").write_bytes(encoded(picture(80, 80), "AVIF"))
    picture().save(photos / "d.jpg", "JPEG")
    (photos / "e.dng").write_bytes(b"II*\x00")
    cfg = shapes_model.bundle.image_cfg
    index = ImageIndex.create(tmp_path / "index", shapes_model.bundle, IndexSettings(),
                              cache=feature_cache(exported(shapes_model.cache / "formats", cfg), cfg),
                              collection_root=photos)
    report = sync_folder(index, photos)
    assert sorted(report.added) == ["a.heic", "b.HEIF", "c.avif", "d.jpg"]
    assert report.unsupported == ["e.dng"] and report.unreadable == []
    sizes = {index.photos.stored_path(rec.path): (rec.width, rec.height)
             for rec in (index.get(int(i)) for i in index.ids()) if rec is not None}
    assert sizes == {"a.heic": (96, 64), "b.HEIF": (64, 96), "c.avif": (80, 80), "d.jpg": (96, 64)}
    index.close()


@pytest.mark.parametrize(("fmt", "suffix", "mime"), [("HEIF", ".heic", "image/heic"), ("AVIF", ".avif", "image/avif")])
def test_an_uploaded_phone_photo_is_annotated(fmt: str, suffix: str, mime: str, client: TestClient,
                                              service_env: ServiceEnv) -> None:
    name = service_env.dev[0]
    picture_ = Image.open(service_env.image_path(name)).convert("RGB").resize((160, 120))
    data = encoded(picture_, fmt)
    r = client.post("/annotate", files={"file": (f"upload{suffix}", data, mime)}, data={"k": "10"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["width"], body["height"]) == (160, 120)
    assert len(body["results"]) == 10 and all(h["alignment"] for h in body["results"])
    # the model sees in the phone format what it sees in the same picture sent losslessly (the whole frame's
    # features): a test of the format, not of the small model's recall, which differs between instruction sets
    bundle = service_env.shapes.bundle
    phone = bundle.extractor.extract(load_image(data)).features[0]
    lossless = bundle.extractor.extract(picture_).features[0]
    cosine = float(phone @ lossless / (np.linalg.norm(phone) * np.linalg.norm(lossless)))
    assert cosine >= 0.95, f"the whole frame's features at cosine {cosine:.3f} with the lossless picture's"
    broken = client.post("/annotate", files={"file": (f"upload{suffix}", data[: len(data) // 2], mime)},
                         data={"k": "3"})
    assert broken.status_code in (415, 422), broken.text
