"""Date taken and place from EXIF: read at indexing, kept in the catalogue (an older catalogue upgraded
in place), and the filters of a search, on photos the tests write with EXIF blocks."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.catalogue import DB_FILE
from fragsearch.index.places import Near, Place, PlaceFilter, distance_km, read_place
from fragsearch.index.types import BackendOptions
from fragsearch.model.dataset import feature_cache
from tests.conftest import exported
from tests.synthetic import make_picture

if TYPE_CHECKING:
    from tests.conftest import ShapesModel, exported

PARIS = (48.8584, 2.2945)
SYDNEY = (-33.8568, 151.2153)


def dms(value: float) -> tuple[float, float, float]:
    value = abs(value)
    d = int(value)
    m = int((value - d) * 60)
    return float(d), float(m), round((value - d - m / 60) * 3600, 4)


def photo(path: Path, seed: int, taken: str | None = None, at: tuple[float, float] | None = None) -> Path:
    """A shapes picture as a JPEG, with an EXIF block holding `taken` (EXIF form) and GPS `at` when given."""
    img = make_picture(random.Random(seed))[0]
    exif = Image.Exif()
    if taken is not None:
        exif.get_ifd(0x8769)[36867] = taken
    if at is not None:
        gps = exif.get_ifd(0x8825)
        gps[1], gps[2] = ("N" if at[0] >= 0 else "S"), dms(at[0])
        gps[3], gps[4] = ("E" if at[1] >= 0 else "W"), dms(at[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, "JPEG", quality=90, exif=exif)
    return path


def clock(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_exif_date_and_gps_are_read_and_absent_ones_are_none(tmp_path: Path) -> None:
    got = read_place(photo(tmp_path / "a.jpg", 0, "2024:07:14 10:30:00", SYDNEY))
    assert got.taken == clock("2024-07-14T10:30:00")
    assert got.lat is not None and got.lon is not None
    assert abs(got.lat - SYDNEY[0]) < 1e-4 and abs(got.lon - SYDNEY[1]) < 1e-4 and got.lat < 0
    assert read_place(photo(tmp_path / "b.jpg", 1)) == Place()  # an EXIF block without date or GPS
    make_picture(random.Random(2))[0].save(tmp_path / "c.png")
    assert read_place(tmp_path / "c.png") == Place()  # no EXIF at all
    (tmp_path / "d.jpg").write_bytes(b"\xff\xd8\xff\xe1\x00\x10Exif\x00\x00garbage")
    assert read_place(tmp_path / "d.jpg") == Place()  # damaged: no value, no error
    assert read_place(photo(tmp_path / "e.jpg", 3, "not a date")).taken is None


def test_distance_and_filter_mask() -> None:
    assert abs(float(distance_km(SYDNEY[0], SYDNEY[1], *PARIS)) - 16_960) < 60  # Paris–Sydney
    f = PlaceFilter(taken_after=clock("2024-01-01T00:00:00"), near=Near(*PARIS, km=10))
    taken = np.array([clock("2024-05-01T00:00:00"), clock("2023-05-01T00:00:00"), np.nan, clock("2024-05-01T00:00:00")])
    lat = np.array([PARIS[0] + 0.01, PARIS[0], PARIS[0], SYDNEY[0]])
    lon = np.array([PARIS[1], PARIS[1], PARIS[1], SYDNEY[1]])
    assert f.keeps(taken, lat, lon).tolist() == [True, False, False, False]
    assert not PlaceFilter() and f


@pytest.fixture
def album(tmp_path: Path) -> dict[str, Path]:
    """Five photos: two in Paris in summer 2024, one in Sydney in winter 2023, one with a date only,
    one without EXIF data."""
    root = tmp_path / "album"
    return {
        "paris-july": photo(root / "paris-july.jpg", 10, "2024:07:14 10:30:00", PARIS),
        "paris-august": photo(root / "paris-august.jpg", 11, "2024:08:02 18:00:00", (PARIS[0] + 0.02, PARIS[1])),
        "sydney": photo(root / "sydney.jpg", 12, "2023:12:24 09:00:00", SYDNEY),
        "dated": photo(root / "dated.jpg", 13, "2024:07:20 12:00:00"),
        "bare": photo(root / "bare.jpg", 14),
    }


def _names(index: ImageIndex, ids: np.ndarray) -> set[str]:
    return {Path(index.get(int(i)).path).stem for i in ids}  # type: ignore[union-attr]


def _check_filters(index: ImageIndex) -> None:
    summer = PlaceFilter(taken_after=clock("2024-06-01T00:00:00"), taken_before=clock("2024-09-01T00:00:00"))
    assert _names(index, index.photos.allowed(summer)) == {"paris-july", "paris-august", "dated"}
    assert _names(index, index.photos.allowed(PlaceFilter(near=Near(*PARIS, km=5)))) == {"paris-july", "paris-august"}
    assert _names(index, index.photos.allowed(PlaceFilter(near=Near(*PARIS, km=1)))) == {"paris-july"}
    july = PlaceFilter(taken_before=clock("2024-08-01T00:00:00"), near=Near(*PARIS, km=5))
    assert _names(index, index.photos.allowed(july)) == {"paris-july"}
    assert len(index.photos.allowed(PlaceFilter(near=Near(0.0, 0.0, km=100)))) == 0


def test_the_index_keeps_date_and_place_and_filters_by_them(shapes_model: ShapesModel, tmp_path: Path,
                                                            album: dict[str, Path]) -> None:
    cache = feature_cache(exported(tmp_path / "cache", shapes_model.bundle.image_cfg), shapes_model.bundle.image_cfg)
    index = ImageIndex.create(tmp_path / "index", shapes_model.bundle, IndexSettings(), cache=cache)
    index.photos.add(list(album.values()))
    _check_filters(index)  # pending: from memory
    index.save()
    index.close()
    again = ImageIndex.load(tmp_path / "index", shapes_model.bundle, cache=cache)
    _check_filters(again)  # saved: from the catalogue
    gone = again.photos.find([album["paris-july"]])[str(album["paris-july"])]
    again.remove(gone)
    assert _names(again, again.photos.allowed(PlaceFilter(near=Near(*PARIS, km=5)))) == {"paris-august"}
    again.close()


def test_an_older_catalogue_is_upgraded_in_place_and_its_images_read(shapes_model: ShapesModel, tmp_path: Path,
                                                                     album: dict[str, Path]) -> None:
    cache = feature_cache(exported(tmp_path / "cache", shapes_model.bundle.image_cfg), shapes_model.bundle.image_cfg)
    index = ImageIndex.create(tmp_path / "index", shapes_model.bundle, IndexSettings(), cache=cache)
    index.photos.add(list(album.values()))
    index.save()
    index.close()
    db = sqlite3.connect(tmp_path / "index" / DB_FILE)  # the catalogue as the previous version wrote it
    for column in ("taken", "lat", "lon", "exif_read", "labels"):
        db.execute(f"ALTER TABLE items DROP COLUMN {column}")
    db.commit()
    db.close()

    old = ImageIndex.load(tmp_path / "index", shapes_model.bundle, cache=cache)
    assert len(old) == 5 and old.get(int(old.ids()[0])) is not None
    with sqlite3.connect(tmp_path / "index" / DB_FILE) as db:
        cols = {row[1] for row in db.execute("PRAGMA table_info(items)")}
    assert {"taken", "lat", "lon", "exif_read", "labels"} <= cols
    assert old.get(int(old.ids()[0])).labels == ()  # type: ignore[union-attr]  # no detector labels: none stored
    assert len(old.photos.allowed(PlaceFilter(near=Near(*PARIS, km=5)))) == 0  # not read yet: unknown
    assert old.photos.read_missing_places() == 5
    assert old.photos.read_missing_places() == 0  # read once
    _check_filters(old)
    old.close()


def album_index(shapes_model: ShapesModel, tmp_path: Path, album: dict[str, Path],
                backend: BackendOptions) -> ImageIndex:
    """The album indexed with `backend` and saved, searched through the candidates (exact_below 0) with a
    k' that holds every fragment."""
    cache = feature_cache(exported(tmp_path / "cache", shapes_model.bundle.image_cfg), shapes_model.bundle.image_cfg)
    images = ImageIndex.create(tmp_path / "images", shapes_model.bundle, IndexSettings.of(exact_below=0, k_prime=4096),
                               cache=cache, collection_root=tmp_path / "album", backend=backend)
    images.photos.add(list(album.values()))
    images.save()
    return images


@contextmanager
def album_search(shapes_model: ShapesModel, tmp_path: Path,
                 images: ImageIndex) -> Iterator[tuple[TestClient, Callable[..., list[str]]]]:
    """The app over `images`, and `names(**body)`: the photos POST /search/images returns for "a red circle"
    with the body's filters, in order."""
    from fragsearch.service.app import create_app
    from fragsearch.service.engine import Engine
    from tests.conftest_service import make_settings

    settings = make_settings(shapes_model, tmp_path, image_index=tmp_path / "images")
    with TestClient(create_app(settings, engine=Engine(settings, shapes_model.bundle, images, None))) as c:
        def names(**body: object) -> list[str]:
            r = c.post("/search/images", json={"sentence": "a red circle", "k": 10, **body})
            assert r.status_code == 200, r.text
            return [x["name"] for x in r.json()["results"]]

        yield c, names


@pytest.mark.parametrize("backend", ["faiss", "milvus"])
def test_search_filters_before_the_exact_rerank(shapes_model: ShapesModel, tmp_path: Path, album: dict[str, Path],
                                                backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the candidates (no exact scan of the allowed images): Milvus gets the allowed ids as a
    filter expression, FAISS's candidates are filtered after; both rank what the exact scan ranks."""
    import fragsearch.index.ranker

    monkeypatch.setattr(fragsearch.index.ranker, "FILTERED_EXACT", 0)
    images = album_index(shapes_model, tmp_path, album, BackendOptions(backend))
    with album_search(shapes_model, tmp_path, images) as (c, names):
        everything = names()
        assert len(everything) == 5
        paris = names(near={"lat": PARIS[0], "lon": PARIS[1], "km": 5})
        assert paris == [n for n in everything if n.startswith("paris")]  # the same order as unfiltered
        near_paris = PlaceFilter(near=Near(*PARIS, km=5))
        assert images.search("a red circle", 1, where=near_paris).collection == 2  # what a relevance reads
        assert images.search("a red circle", 1).collection == 5
        summer = names(taken_after="2024-06-01", taken_before="2024-09-01")
        assert summer == [n for n in everything if n in ("paris-july.jpg", "paris-august.jpg", "dated.jpg")]
        assert names(taken_after="2024-07-14T10:30:00", taken_before="2024-07-14T10:30:01") == ["paris-july.jpg"]
        first = c.post("/search/images", json={"sentence": "a red circle", "near": {"lat": 0, "lon": 0, "km": 1}})
        assert first.json()["results"] == [] and "no photo passes" in first.json()["reason"]
        hit = c.post("/search/images", json={"sentence": "a red circle", "k": 1,
                                             "near": {"lat": SYDNEY[0], "lon": SYDNEY[1], "km": 1}}).json()
        assert hit["results"][0]["taken"] == "2023-12-24T09:00:00"
        assert abs(hit["results"][0]["lat"] - SYDNEY[0]) < 1e-4
        for bad in ({"taken_after": "2024-09-01", "taken_before": "2024-06-01"},
                    {"taken_after": "last summer"},
                    {"near": {"lat": 91, "lon": 0, "km": 1}},
                    {"near": {"lat": 0, "lon": 0, "km": 0}},
                    {"near": {"lat": 0, "lon": 0}}):
            r = c.post("/search/images", json={"sentence": "a red circle", **bad})
            assert r.status_code == 422, (bad, r.text)
            assert r.json()["error"]["message"]
        assert images.searches["candidates"] > 0 and images.searches["scan"] == 0
    images.close()
