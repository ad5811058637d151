"""The device setting (model/device.py) and checkpoint loading without code (model/bundle.py), on the CPU.

The same paths on a GPU are in tests/test_gpu.py (marked `gpu`, skipped without one).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fragsearch.model.bundle import Bundle, CheckpointError
from fragsearch.model.device import DeviceError, check_device_name, device_name, resolve_device
from tests.conftest import ShapesModel

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = not torch.cuda.is_available()


def test_device_names_are_checked_and_normalised() -> None:
    assert check_device_name(" CUDA ") == "cuda"
    assert check_device_name("cuda:1") == "cuda:1"
    for bad in ("gpu", "cuda:", "mps", ""):
        with pytest.raises(DeviceError, match="auto, cpu, cuda"):
            check_device_name(bad)


def test_auto_is_the_gpu_only_when_there_is_one() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_clear_error() -> None:
    with pytest.raises(DeviceError, match="no GPU") as err:
        device_name("cuda")
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
@pytest.mark.parametrize("module", ["service", "fragsearch.service.prepare"])
def test_service_with_cuda_and_no_gpu_stops_at_start_with_one_line(module: str, tmp_path: Path) -> None:
    env = {**os.environ, "FRAGSEARCH_DEVICE": "cuda", "FRAGSEARCH_ARTIFACTS": str(tmp_path),
           "FRAGSEARCH_DATA": str(tmp_path / "no-data")}
    r = subprocess.run([sys.executable, "-m", module], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot start: device 'cuda'" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "models").exists()  # nothing was prepared


def test_bundle_loads_on_the_cpu_and_hands_back_numpy_arrays(shapes_model: ShapesModel) -> None:
    bundle = Bundle.load(shapes_model.model_path, device="auto")
    assert bundle.device == resolve_device("auto")
    assert bundle.text.device == bundle.device
    enc = bundle.text.encode(["a red circle", "a blue square"])
    sent, mask = bundle.embed_sentences(enc)
    img = bundle.embed_images(shapes_model.dev.feats[:3])
    scores = bundle.scores(img, np.ones(img.shape[:2], np.float32), sent, mask)
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in (sent, mask, img, scores))
    assert scores.shape == (3, 2)


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_bundle_on_cuda_without_a_gpu_is_a_device_error(shapes_model: ShapesModel) -> None:
    with pytest.raises(DeviceError):
        Bundle.load(shapes_model.model_path, device="cuda")


class _RunsCode:
    """Unpickling this object would create `marker` (what a malicious checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(
        shapes_model: ShapesModel, tmp_path: Path) -> None:
    state = torch.load(shapes_model.model_path, map_location="cpu", weights_only=True)
    marker = tmp_path / "code-ran"
    state["meta"] = {"note": _RunsCode(marker)}
    bad = tmp_path / "model.pt"
    torch.save(state, bad)
    with pytest.raises(CheckpointError, match="cannot read model checkpoint"):
        Bundle.load(bad)
    assert not marker.exists()
    # the same object in a plain pickle does run code: the test would notice if loading unpickled it
    pickle.loads(pickle.dumps(_RunsCode(marker)))
    assert marker.exists()


def test_foreign_and_damaged_files_are_clear_errors(shapes_model: ShapesModel, tmp_path: Path) -> None:
    noise = tmp_path / "noise.pt"
    noise.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match="cannot read model checkpoint"):
        Bundle.load(noise)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(CheckpointError, match="not a fragsearch checkpoint"):
        Bundle.load(foreign)
    state = torch.load(shapes_model.model_path, map_location="cpu", weights_only=True)
    del state["state_dict"]
    broken = tmp_path / "broken.pt"
    torch.save(state, broken)
    with pytest.raises(CheckpointError, match="damaged or incompatible"):
        Bundle.load(broken)
    with pytest.raises(CheckpointError, match="not found"):
        Bundle.load(tmp_path / "absent.pt")
