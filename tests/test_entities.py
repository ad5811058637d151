"""Flickr30k Entities (model/entities.py): the reader on annotation files the tests write (a caption matched to
its line, boxes scaled to the 224 px copy, from the archive and from a folder), and the grounding measure
(bench/grounding.py) on the shapes pictures, whose boxes the tests know."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from bench.grounding import Tally, ground
from fragsearch.model.data import load_split
from fragsearch.model.entities import (
    ARCHIVE,
    FOLDER,
    EntitiesError,
    image_id,
    normalise,
    parse_caption,
    read_entities,
)
from tests.conftest import ShapesModel

SENTENCES = """[/EN#1/people A man] in [/EN#2/clothing a red hat] walks [/EN#3/animals/other his dog] .
[/EN#1/people A man] walks on [/EN#4/scene the beach] with [/EN#0/notvisual something] .
[/EN#3/animals A black-and-white dog] runs .
"""
ANNOTATION = """<annotation><size><width>500</width><height>250</height><depth>3</depth></size>
<object><name>1</name><bndbox><xmin>101</xmin><ymin>51</ymin><xmax>201</xmax><ymax>151</ymax></bndbox></object>
<object><name>1</name><name>2</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>51</xmax><ymax>26</ymax></bndbox></object>
<object><name>3</name><bndbox><xmin>301</xmin><ymin>101</ymin><xmax>501</xmax><ymax>251</ymax></bndbox></object>
<object><name>4</name><scene>1</scene><nobndbox>0</nobndbox></object>
<object><name>5</name><scene>0</scene><nobndbox>1</nobndbox></object>
</annotation>"""


def write_folder(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / FOLDER / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def write_archive(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(root / ARCHIVE, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{FOLDER}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return root


FILES = {"Sentences/1234.txt": SENTENCES, "Annotations/1234.xml": ANNOTATION,
         "Sentences/999.txt": SENTENCES, "Annotations/999.xml": ANNOTATION}


@pytest.mark.parametrize("layout", ["archive", "folder"])
def test_the_reader_matches_captions_and_scales_boxes_to_the_copy(tmp_path: Path, layout: str) -> None:
    root = (write_archive if layout == "archive" else write_folder)(tmp_path / "entities", FILES)
    ents = read_entities(root, ["1234_abcdef.jpg"])
    assert list(ents) == ["1234_abcdef.jpg"]  # only the images asked for, by their Flickr8K name
    e = ents["1234_abcdef.jpg"]
    assert (e.width, e.height) == (500, 250) and len(e.captions) == 3
    first = e.captions[0]
    assert [p.text for p in first.phrases] == ["a man", "a red hat", "his dog"]
    assert first.phrases[2].types == ("animals", "other") and first.phrases[2].head == "dog"
    assert first.words[first.phrases[1].start : first.phrases[1].start + 3] == ("a", "red", "hat")
    # a Flickr8K caption: equal once lowercased and stripped of punctuation, or alike at a ratio >= 0.9
    assert e.match("A man in a red hat walks his dog.") is first
    assert e.match("A black and white dog runs") is e.captions[2]
    assert e.match("a black and white dogs run .") is e.captions[2]
    assert e.match("Two cats sleep on a sofa .") is None
    # 1-based pixels of the 500 x 250 original, squashed to 224 x 224: x -> (x - 1) * 224 / 500
    np.testing.assert_allclose(e.boxes_at("1", 224, 224), [[44.8, 44.8, 89.6, 134.4], [0, 0, 22.4, 22.4]],
                               atol=1e-4)
    np.testing.assert_allclose(e.boxes_at("3", 224, 224), [[134.4, 89.6, 224, 224]], atol=1e-4)
    assert e.boxes_at("4", 224, 224).shape == (0, 4) and e.scene == {"4"} and e.no_box == {"5"}


def test_names_and_bad_annotations(tmp_path: Path) -> None:
    assert image_id("1000268201_693b08cb0e.jpg") == "1000268201" and image_id("shape_0001.jpg") == "shape_0001"
    assert normalise("A black-and-white dog, running!") == "a black and white dog running"
    assert parse_caption("a dog .").phrases == ()
    with pytest.raises(EntitiesError, match="neither"):
        read_entities(tmp_path)
    broken = write_folder(tmp_path / "broken", {"Sentences/7.txt": SENTENCES, "Annotations/7.xml": "<annotation>"})
    with pytest.raises(EntitiesError, match="unreadable annotation"):
        read_entities(broken)


def test_a_tally_scores_answers_and_baselines_on_known_boxes() -> None:
    fragments = np.asarray([[0, 0, 224, 224], [10, 10, 60, 60], [100, 100, 200, 200]], np.float32)
    truth = np.asarray([[12, 12, 60, 62]], np.float32)
    t = Tally()
    t.add([10, 10, 60, 60], truth, fragments)  # the right region
    t.add([0, 0, 224, 224], truth, fragments)  # the whole image: its centre is not in the box
    t.add(None, truth, fragments)  # no answer
    row = t.row()
    assert row["phrases"] == 3 and row["answered"] == pytest.approx(66.7)
    assert row["accuracy"] == pytest.approx(33.3) and row["pointing"] == pytest.approx(33.3)
    assert row["whole_image"] == 0.0 and row["upper_bound"] == 100.0
    assert row["random_fragment"] == pytest.approx(33.3)  # one fragment of three holds it


def shapes_entities(data: Path, root: Path) -> Path:
    """Entities files for the shapes pictures of `data` (both splits): each caption's two shapes are its two
    phrases, boxed where objects.json says they are drawn (1-based, as the release writes them)."""
    files: dict[str, str] = {}
    objects = json.loads((data / "objects.json").read_text())
    for split in ("train", "dev"):
        sp = load_split(data, split)
        for name, captions in zip(sp.images, sp.captions, strict=True):
            a, b = objects[name]
            lines = []
            for caption in captions:
                line = " ".join(caption.split())
                for chain, o in ((1, a), (2, b)):
                    named = f"{o['colour']} {o['shape']}"
                    line = line.replace(named, f"[/EN#{chain}/other {named}]")
                lines.append(line)
            files[f"Sentences/{image_id(name)}.txt"] = "\n".join(lines) + "\n"
            boxes = "".join(f"<object><name>{n}</name><bndbox><xmin>{o['box'][0] + 1}</xmin><ymin>{o['box'][1] + 1}"
                            f"</ymin><xmax>{o['box'][2] + 1}</xmax><ymax>{o['box'][3] + 1}</ymax></bndbox></object>"
                            for n, o in ((1, a), (2, b)))
            files[f"Annotations/{image_id(name)}.xml"] = (f"<annotation><size><width>224</width><height>224</height>"
                                                           f"</size>{boxes}</annotation>")
    return write_folder(root, files)


def test_grounding_on_the_shapes_pictures(shapes_model: ShapesModel, tmp_path: Path) -> None:
    """Each shapes caption names two shapes; their boxes are known (objects.json). The whole image never holds
    a shape at IoU 0.5 (a shape is a ninth of it), the regions do; the answers are scored like the baselines."""
    dev = load_split(shapes_model.data, "dev")
    root = shapes_entities(shapes_model.data, tmp_path / "entities")
    result = ground(shapes_model.bundle, shapes_model.data, root, shapes_model.cache, workers=1, limit=None,
                    examples=2)
    assert result.matched == result.captions == sum(len(c) for c in dev.captions)
    phrase = result.tallies[("phrase", "all")].row()
    assert phrase["phrases"] == 2 * result.matched
    assert phrase["whole_image"] == 0.0 and phrase["upper_bound"] >= 50.0
    assert phrase["random_fragment"] <= phrase["upper_bound"]
    assert 0.0 <= phrase["accuracy"] <= phrase["upper_bound"]
    assert len(result.examples) <= 2
