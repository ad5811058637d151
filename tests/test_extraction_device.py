"""Extraction workers stay off the GPU: a pool of worker processes runs on the CPU whatever the device
the service runs on (model.device.extraction_device), so that one worker per CPU of a many-core GPU host
does not open one CUDA context each. The same pool on a real GPU: tools/gpu_check.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from fragsearch.model.device import extraction_device
from fragsearch.model.extraction import ExtractionPool
from fragsearch.model.features import content_key, read_entry
from fragsearch.model.release import read_manifest
from fragsearch.model.variants import load_variant


@pytest.mark.parametrize(("device", "workers", "expected"), [
    ("cuda", 16, "cpu"), ("cuda:1", 2, "cpu"), (torch.device("cuda", 0), 64, "cpu"),  # a pool: the CPU
    ("cuda", 1, "cuda"), ("cuda:1", 1, "cuda:1"), ("cpu", 1, "cpu"), ("cpu", 8, "cpu"),  # in process: as given
])
def test_extraction_workers_run_on_the_cpu(device: str | torch.device, workers: int, expected: str) -> None:
    assert extraction_device(device, workers) == expected


def _pictures(folder: Path, n: int) -> list[Path]:
    out = []
    for k in range(n):
        image = Image.new("RGB", (96, 80), (240, 240, 240))
        ImageDraw.Draw(image).ellipse((10 + 5 * k, 10, 60 + 5 * k, 60), fill=(200, 30 + 40 * k, 30))
        out.append(folder / f"p{k}.png")
        image.save(out[-1])
    return out


def test_a_pool_for_a_cuda_service_extracts_on_the_cpu(tmp_path: Path) -> None:
    """A pool made for a service on `cuda` (what prepare makes on a GPU host) starts its workers on the CPU:
    on a machine without a GPU they would otherwise each stop at 'torch sees no GPU', on a GPU host each
    would hold a CUDA context. Their entries are the CPU's."""
    cfg = load_variant(read_manifest()["name"]).image  # the released model's image settings
    paths = _pictures(tmp_path, 3)
    (tmp_path / "out").mkdir()
    with ExtractionPool(cfg, "cuda", workers=2) as pool:
        assert pool.worker_device == "cpu"
        done, failed = pool.run(paths, batch=1, out_dir=tmp_path / "out", progress=False)  # one task per file
    assert (done, failed) == (3, [])
    with ExtractionPool(cfg, "cpu", workers=1) as here:
        (tmp_path / "here").mkdir()
        here.run(paths, batch=8, out_dir=tmp_path / "here", progress=False)
    for path in paths:
        name = f"{content_key(path.read_bytes())}.npz"
        pooled, direct = read_entry(tmp_path / "out" / name), read_entry(tmp_path / "here" / name)
        np.testing.assert_array_equal(pooled.boxes, direct.boxes)
        np.testing.assert_allclose(pooled.features, direct.features, rtol=2e-3, atol=2e-3)
