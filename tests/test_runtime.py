"""The service runs without the training stack: what it imports pulls in no torch, and the runtime's NumPy path
(model/encoders.py, model/score.py, model/calibration.py over ONNX Runtime's graphs) gives the numbers of the
torch path training uses (training/nets/: the torch modules, S_kl and calibration on tensors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fragsearch.index.ranker import rank_key
from fragsearch.model.bundle import Bundle
from fragsearch.model.calibration import Calibration
from fragsearch.model.fragments import pad
from fragsearch.model.release import RELEASED_MODEL
from fragsearch.model.score import skl
from fragsearch.training.calibrate import fit_calibration
from fragsearch.training.nets.checkpoint import Checkpoint
from tests.conftest import ShapesModel

ROOT = Path(__file__).resolve().parent.parent
TRAINING_STACK = ("torch", "torchvision", "triton", "transformers", "sentence_transformers", "sklearn", "scipy",
                  "onnx")
SERVED_MODULES = tuple(f"fragsearch.{m}" for m in (
    "service.app", "service.prepare", "service.engine", "index.build", "index.sync", "index.bulk",
    "commands.serve", "commands.prepare", "commands.terminal", "commands.options", "commands.index_build",
    "commands.index_sync", "commands.index_bulk", "commands.duplicates",
    "model.bundle", "model.embed", "model.image", "model.words"))


def _python(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# Run in a fresh interpreter: records which file imports a module of the training stack (the frame that runs the
# import statement), then imports `modules` and prints [(module, importer)] for the importers in the project.
WATCH = r"""
import importlib, json, sys
root, forbidden, modules = sys.argv[1], set(sys.argv[2].split(",")), sys.argv[3].split(",")
found = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in forbidden:
            f = sys._getframe(1)
            while f is not None and f.f_code.co_filename.startswith("<frozen"):
                f = f.f_back
            importer = f.f_code.co_filename if f is not None else "?"
            if importer.startswith(root) and "/site-packages/" not in importer:
                found.append([name, importer[len(root) + 1:].removeprefix("fragsearch/")])
        return None
sys.meta_path.insert(0, Watch())
for m in modules:
    importlib.import_module(m)
print(json.dumps(found))
"""


def project_imports_of(stack: tuple[str, ...], modules: tuple[str, ...]) -> list[list[str]]:
    out = subprocess.run([sys.executable, "-c", WATCH, str(ROOT), ",".join(stack), ",".join(modules)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found: list[list[str]] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def test_the_served_modules_import_no_training_stack() -> None:
    """No file of the project that `./run serve` and `./run index` import imports torch, transformers,
    scikit-learn or onnx (a fresh interpreter, every import statement watched: a library that tries torch on
    its own where it is installed, as spaCy's thinc does, is not the project's import); and with the training
    stack impossible to import, every served module imports."""
    assert project_imports_of(TRAINING_STACK, SERVED_MODULES) == []
    code = (f"import importlib, sys\nfor m in {TRAINING_STACK!r}: sys.modules[m] = None\n"
            f"for m in {SERVED_MODULES!r}: importlib.import_module(m)\nprint('ok')\n")
    out = _python(code)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_serving_loads_no_torch_where_it_is_installed() -> None:
    """Where torch is installed (this environment), importing the served modules and parsing a sentence with
    spaCy leave it unloaded: thinc's own try of torch is refused while spaCy is imported (model/parsers.py),
    so a service run from the dev environment does not hold torch's 500 MB."""
    pytest.importorskip("torch")
    code = (f"import importlib, sys\nfor m in {SERVED_MODULES!r}: importlib.import_module(m)\n"
            "from fragsearch.model.parsers import make_parser\n"
            "make_parser('spacy').parse(['a dog runs on the grass'])\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = _python(code, {"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_module_that_pulls_torch_in_is_caught() -> None:
    """The watch above names a project file that imports torch (the torch side, training/nets/)."""
    found = project_imports_of(TRAINING_STACK, ("fragsearch.training.nets.encoders",))
    assert ["torch", "training/nets/encoders.py"] in found


def _torch_path_scores(ckpt: Checkpoint, feats: np.ndarray, parsed: list, sentences: list[str],
                       cal: Calibration | None) -> np.ndarray:
    """S_kl (K, L) the way training computes it: the torch modules, the calibration and S_kl on tensors."""
    model = ckpt.model.eval()
    enc = ckpt.text.encode_parsed(parsed, sentences)
    rel, a, b, mask = pad(enc)
    pool, a, b = ckpt.text.pool_of(enc, a, b)
    t = torch.from_numpy
    with torch.no_grad():
        img = model.embed_images(t(np.asarray(feats, np.float32)))
        sent = model.embed_sentences(t(pool), t(rel), t(a), t(b), t(mask))
        m = t(mask.astype(np.float32))
        if cal is not None:
            cal_t = Calibration(t(cal.ref_images), t(cal.ref_sentences), t(cal.ref_sentence_mask),
                                cal.floor_image, cal.floor_sentence)
            img = cal_t.calibrate_images(img, ckpt.blocks)
            sent = cal_t.calibrate_sentences(sent, m, ckpt.blocks)
        return skl(img, torch.ones(img.shape[:2]), sent, m, blocks=ckpt.blocks).numpy()


@pytest.mark.parametrize("calibrated", [False, True])
def test_the_runtime_scores_and_ranks_as_the_torch_path(shapes_model: ShapesModel, calibrated: bool) -> None:
    """On the tests' dev split: every S_kl within 1e-4 (relative) of the torch path's, and both directions'
    rankings the same as the service ranks (index.ranker.rank_key: scores equal to its digits tie, and a tie
    goes to the smaller id)."""
    ckpt = Checkpoint.load(shapes_model.model_path)
    dev = shapes_model.dev
    if calibrated:
        ckpt.calibration = fit_calibration(ckpt, dev, refs=12, seed=1)
    bundle = ckpt.bundle()
    enc = bundle.text.encode_parsed(dev.parsed, dev.sentences)
    img = bundle.embed_images(dev.feats)
    sent, mask = bundle.embed_sentences(enc)
    runtime = bundle.scores(img, np.ones(img.shape[:2], np.float32), sent, mask)
    reference = _torch_path_scores(ckpt, dev.feats, dev.parsed, dev.sentences, ckpt.calibration)
    assert isinstance(runtime, np.ndarray) and runtime.shape == reference.shape == (len(dev.names), len(dev.sentences))
    np.testing.assert_allclose(runtime, reference, rtol=1e-4, atol=1e-6)

    def rankings(scores: np.ndarray) -> list[list[int]]:
        ids = np.arange(scores.shape[0])
        return [np.lexsort((ids, -rank_key(column))).tolist() for column in scores.T]

    assert rankings(runtime) == rankings(reference)  # images for each sentence
    assert rankings(runtime.T) == rankings(reference.T)  # sentences for each image



def test_the_runtimes_form_loads_without_torch_and_scores_alike(shapes_model: ShapesModel, tmp_path: Path) -> None:
    """A trained model exported to the runtime's form (model.json + model.npz) loads in an interpreter where
    torch cannot be imported and gives the .pt's image fragments."""
    bundle = Bundle.load(shapes_model.model_path)
    bundle.save(tmp_path / "model")
    feats = shapes_model.dev.feats[:3]
    np.save(tmp_path / "feats.npy", feats)
    code = ("import sys\n"
            "for m in ('torch', 'torchvision', 'transformers', 'sentence_transformers'): sys.modules[m] = None\n"
            "import numpy as np\nfrom fragsearch.model.bundle import Bundle\n"
            f"b = Bundle.load({str(tmp_path / 'model')!r}, device='cpu')\n"
            f"np.save({str(tmp_path / 'out.npy')!r}, b.embed_images(np.load({str(tmp_path / 'feats.npy')!r})))\n")
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert np.array_equal(np.load(tmp_path / "out.npy"), bundle.embed_images(feats))


def test_a_trainers_checkpoint_without_torch_says_how_to_serve_it(shapes_model: ShapesModel) -> None:
    code = ("import sys\nsys.modules['torch'] = None\nfrom fragsearch.model.bundle import Bundle, CheckpointError\n"
            "try:\n"
            f"    Bundle.load({str(shapes_model.model_path)!r}, device='cpu')\n"
            "except CheckpointError as e:\n    print(e)\n")
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fragsearch.training.release" in out.stdout and "trainer's checkpoint" in out.stdout


def test_the_released_model_is_in_the_runtimes_form() -> None:
    assert RELEASED_MODEL.name == "model.json" and RELEASED_MODEL.is_file()
    assert not (RELEASED_MODEL.parent / "model.pt").exists()
