"""Merging fragment models into one: the merged fragments are the members' side by side; with blocks,
its one S_kl is the sum of the members' (calibrated) S_kl, and it is served as any checkpoint."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from bench.report import selection_label
from fragsearch.commands.merge import main as merge_main
from fragsearch.index import ImageIndex, IndexSettings
from fragsearch.index.images import embedded_images
from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import SplitData, hold_out, load_split_data
from fragsearch.model.encoders import ModelConfig
from fragsearch.model.parsers import make_parser
from fragsearch.model.score import skl
from fragsearch.service.app import create_app
from fragsearch.training.calibrate import fit_calibration
from fragsearch.training.evaluate import score_split
from fragsearch.training.merge import merge_bundles, merge_models
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import FragmentModel
from fragsearch.training.train import make_run, split_for_selection, train, train_members, train_on
from tests.conftest import ShapesModel
from tests.conftest_service import engine_over_dev


def _member(seed: int, h: int) -> FragmentModel:
    torch.manual_seed(seed)
    model = FragmentModel(ModelConfig(h=h, n_relations=3, img_dim=12, word_dim=5, input_dropout=0.2)).eval()
    with torch.no_grad():
        model.image.bias.normal_()  # type: ignore[union-attr,operator]
        for b in model.b_rel:
            b.normal_()
    return model


def test_merged_fragments_are_the_members_side_by_side() -> None:
    members = [_member(0, 4), _member(1, 6), _member(2, 4)]
    merged = merge_models(members, threshold="sum")
    assert merged.cfg.h == 14 and merged.cfg.blocks == 1 and not merged.training
    feats = torch.randn(2, 3, 12)
    pool = torch.randn(9, 5)
    rel = torch.tensor([[0, 1, 2], [2, 0, 0]])
    a, b = torch.randint(0, 9, (2, 3)), torch.randint(0, 9, (2, 3))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    with torch.no_grad():
        img = merged.embed_images(feats)
        sent = merged.embed_sentences(pool, rel, a, b, mask)
        torch.testing.assert_close(img, torch.cat([m.embed_images(feats) for m in members], dim=2))
        torch.testing.assert_close(sent, torch.cat([m.embed_sentences(pool, rel, a, b, mask) for m in members], dim=2))
        # the one S_kl of the merged fragments thresholds the sum of the members' fragment scores
        s = skl(img, torch.ones(img.shape[:2]), sent, mask)
    assert s.shape == (2, 2) and torch.isfinite(s).all()


def test_members_of_other_shapes_are_refused() -> None:
    other = FragmentModel(ModelConfig(h=4, n_relations=2, img_dim=12, word_dim=5))
    with pytest.raises(ValueError, match="differ in shape"):
        merge_models([_member(0, 4), other])
    hidden = FragmentModel(ModelConfig(h=4, n_relations=3, img_dim=12, word_dim=5, image_hidden=8))
    with pytest.raises(ValueError, match="linear"):
        merge_models([hidden, _member(0, 4)])
    with pytest.raises(ValueError, match="need one h"):  # blocks are equal slices of h
        merge_models([_member(0, 4), _member(1, 6)])
    with pytest.raises(ValueError, match="cannot be a member"):
        merge_models([merge_models([_member(0, 4), _member(1, 4)]), _member(2, 8)], threshold="sum")


def test_block_merge_thresholds_each_member_apart() -> None:
    members = [_member(0, 4), _member(1, 4), _member(2, 4)]
    blocks, summed = merge_models(members), merge_models(members, threshold="sum")
    assert blocks.cfg.blocks == 3 and blocks.cfg.h == 12
    feats = torch.randn(3, 5, 12)
    pool = torch.randn(9, 5)
    rel = torch.tensor([[0, 1, 2], [2, 0, 0]])
    a, b = torch.randint(0, 9, (2, 3)), torch.randint(0, 9, (2, 3))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ones = torch.ones(3, 5)
    with torch.no_grad():
        img, sent = blocks.embed_images(feats), blocks.embed_sentences(pool, rel, a, b, mask)
        by_member = sum(skl(m.embed_images(feats), ones, m.embed_sentences(pool, rel, a, b, mask), mask)
                        for m in members)
        torch.testing.assert_close(skl(img, ones, sent, mask, blocks=3), by_member)
        # thresholding the sum (one block) is another score: never larger
        one = skl(summed.embed_images(feats), ones, summed.embed_sentences(pool, rel, a, b, mask), mask)
    assert not torch.allclose(one, by_member) and bool((one <= by_member + 1e-6).all())


# -- merged shapes models: calibrated like an ensemble, saved, loaded, served -------------------------------


@pytest.fixture(scope="module")
def members(shapes_model: ShapesModel, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Checkpoint, Checkpoint, SplitData]:
    """The shapes model and a second run of it with another seed (a real second member), and the training split."""
    root = tmp_path_factory.mktemp("merge-members")
    run = make_run("paper", {"epochs": 30, "dense_epochs": 10, "anneal_epochs": 3, "batch_size": 20, "h": 64,
                             "lr": 3e-3, "eval_every": 10, "seed": 1})
    tr = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, make_parser("spacy"))
    train(run, tr, None, root / "seed1", shapes_model.cache)
    return Checkpoint.load(shapes_model.model_path), Checkpoint.load(root / "seed1" / "model.pt"), tr


def _dev_scores(bundle: Bundle | Checkpoint, shapes: ShapesModel) -> np.ndarray:
    enc = bundle.text.encode_parsed(shapes.dev.parsed, shapes.dev.sentences)
    return score_split(bundle, shapes.dev.feats, enc)


def test_a_calibrated_block_merge_scores_as_the_ensemble_of_its_members(
        members: tuple[Checkpoint, Checkpoint, SplitData], shapes_model: ShapesModel, tmp_path: Path) -> None:
    first, second, tr = members
    merged = merge_bundles([first, second])
    assert merged.blocks == 2 and merged.dim == 128
    rest, _ = hold_out(tr, 10, 0)
    for b in (first, second, merged):  # the same reference draw: each block's references are its member's
        b.calibration = fit_calibration(b, rest, refs=20, seed=0)
    ensemble = _dev_scores(first, shapes_model) + _dev_scores(second, shapes_model)
    np.testing.assert_allclose(_dev_scores(merged, shapes_model), ensemble, rtol=1e-4, atol=1e-6)
    merged.save(tmp_path / "model.pt")
    loaded = Bundle.load(tmp_path / "model.pt")  # the checkpoint records its blocks
    assert loaded.blocks == 2
    np.testing.assert_allclose(_dev_scores(loaded, shapes_model), ensemble, rtol=1e-3, atol=1e-5)


def test_a_checkpoint_without_blocks_scores_exactly_as_before(shapes_model: ShapesModel, tmp_path: Path) -> None:
    state = torch.load(shapes_model.model_path, map_location="cpu", weights_only=True)
    state["model_cfg"].pop("blocks", None)  # as saved before merged models recorded their blocks
    torch.save(state, tmp_path / "old.pt")
    old = Bundle.load(tmp_path / "old.pt")
    assert old.blocks == 1
    img = old.embed_images(shapes_model.dev.feats)
    enc = old.text.encode_parsed(shapes_model.dev.parsed, shapes_model.dev.sentences)
    sent, mask = old.embed_sentences(enc)
    img_mask = np.ones(img.shape[:2], np.float32)
    assert np.array_equal(old.scores(img, img_mask, sent, mask), skl(img, img_mask, sent, mask))


@pytest.fixture(scope="module")
def merged_client(members: tuple[Checkpoint, Checkpoint, SplitData], shapes_model: ShapesModel,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Bundle]]:
    first, second, tr = members
    merged = merge_bundles([first, second])
    merged.calibration = fit_calibration(merged, tr, refs=20, seed=0)
    root = tmp_path_factory.mktemp("merged-service")
    merged.save(root / "model.pt")
    served = Bundle.load(root / "model.pt")
    engine = engine_over_dev(shapes_model, served, root)
    with TestClient(create_app(engine.settings, engine=engine)) as c:
        yield c, served


def test_an_index_of_a_merged_model_answers_searches_through_the_service(
        merged_client: tuple[TestClient, Bundle], shapes_model: ShapesModel) -> None:
    client, bundle = merged_client
    dev = shapes_model.dev
    scores = _dev_scores(bundle, shapes_model)  # (images, sentences): the exact S_kl of the merged model
    in_top5 = 0
    for li in range(0, len(dev.sentences), 5):
        r = client.post("/search/images", json={"sentence": dev.sentences[li], "k": 5})
        assert r.status_code == 200, r.text
        hits = r.json()["results"]
        assert len(hits) == 5 and [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
        assert hits[0]["alignment"], "a merged model's results carry their alignment"
        top = dev.names.index(hits[0]["name"])
        assert hits[0]["score"] == pytest.approx(float(scores[top, li]), rel=1e-3, abs=1e-6)
        in_top5 += dev.names[int(dev.pair_image[li])] in [h["name"] for h in hits]
    assert in_top5 >= 0.6 * len(range(0, len(dev.sentences), 5))


def test_a_merged_model_prescored_on_codes_ranks_its_candidates_by_its_own_score(
        members: tuple[Checkpoint, Checkpoint, SplitData], shapes_model: ShapesModel, tmp_path: Path) -> None:
    """The prescore codes (index.codes) project all members' slices together, so their approximate
    score is one block, whatever the model's blocks; the exact re-rank is the model's block S_kl. A
    code dimension that does not split into the members' blocks is accepted (candidates on)."""
    first, second, _ = members
    merged = merge_bundles([first, second]).bundle()
    dev = shapes_model.dev
    vecs = merged.embed_images(dev.feats)
    n = len(vecs)
    ix = ImageIndex.create(tmp_path / "idx", merged, IndexSettings.of(store_dtype="float16", codes=25))
    boxes = np.tile(np.array([0, 0, 64, 64], np.float32), (n, vecs.shape[1], 1))
    ix.add(embedded_images(vecs, boxes, np.tile([64, 64], (n, 1))), dev.names,
           [f"/shapes/{name}" for name in dev.names], read_places=False)
    ix.save()
    assert ix.codes is not None and ix.codes.dim == 25
    ix.set_search(exact_below=0, k_prime=ix.candidates.ntotal + 1, rerank=n // 2)
    scores = _dev_scores(merged, shapes_model)
    for li in range(0, len(dev.sentences), 7):
        page = ix.search(dev.sentences[li], 5, 0)
        assert page.considered == n // 2  # the re-rank read only the codes' best half
        exact = [dev.names[i] for i in np.argsort(-scores[:, li], kind="stable")[:5].tolist()]
        hit_scores = [h.score for h in page.hits]
        assert hit_scores == sorted(hit_scores, reverse=True)
        top = dev.names.index(page.hits[0].name)
        assert page.hits[0].score == pytest.approx(float(scores[top, li]), rel=1e-2, abs=1e-5)
        assert page.hits[0].name == exact[0]
        why = ix.explain(page.hits[0].image_id, dev.sentences[li])  # ranked over the same candidates
        assert why is not None and why.rank == 1 and why.scope == "candidates"
        assert why.score == pytest.approx(page.hits[0].score, rel=1e-5)
    ix.close()


def test_a_merge_of_members_selected_on_validation_fits_its_relevance_scale(shapes_model: ShapesModel,
                                                                             tmp_path: Path) -> None:
    """`python -m fragsearch.training.merge` fits the merged score's relevance scale on the members' validation part
    (as training fits a member's), so the merged checkpoint answers `min_relevance` without a separate
    calibration run."""
    folders = []
    for seed in (0, 1):
        run = make_run("paper", {"epochs": 30, "dense_epochs": 10, "anneal_epochs": 3, "batch_size": 20, "h": 32,
                                 "lr": 3e-3, "eval_every": 10, "seed": seed, "selection": "val", "val_images": 12,
                                 "calibrate": 20})
        data = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, make_parser("spacy"))
        tr, val = split_for_selection(run.train, data)
        folder = tmp_path / f"run{seed}" / "member-1"  # two runs' first members: folders of one name
        train(run, tr, val, folder, shapes_model.cache)
        folders.append(str(folder))
    merge_main(["--members", *folders, "--out", str(tmp_path / "merged"), "--data", str(shapes_model.data),
                "--cache", str(shapes_model.cache)])
    merged = Bundle.load(tmp_path / "merged" / "model.pt")
    assert merged.blocks == 2 and merged.calibration is not None
    val = json.loads((tmp_path / "merged" / "history.json").read_text())["val"]
    assert set(val) == {*folders, "merged"}, "each member's validation numbers, under its path when names repeat"
    assert merged.calibration.relevance is not None and "relevance" in merged.meta["calibration"]
    assert merged.meta["calibration"]["relevance"]["images"] == 12


def test_the_merge_command_refuses_members_it_cannot_merge_before_loading_data(shapes_model: ShapesModel,
                                                                              tmp_path: Path) -> None:
    """Members of other shapes are refused with the reason, before the training data is read (the data
    folder here does not exist: a refusal after loading would fail on it instead)."""
    ckpt = Checkpoint.load(shapes_model.model_path)
    assert isinstance(ckpt.model, FragmentModel)
    other = FragmentModel(dataclasses.replace(ckpt.model.cfg, h=ckpt.model.cfg.h * 2))
    Checkpoint(ckpt.model, ckpt.text, ckpt.image_cfg, meta=dict(ckpt.meta)).save(tmp_path / "a" / "model.pt")
    Checkpoint(other, ckpt.text, ckpt.image_cfg, meta=dict(ckpt.meta)).save(tmp_path / "b" / "model.pt")
    with pytest.raises(SystemExit) as exit_info:
        merge_main(["--members", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "merged"),
                    "--data", str(tmp_path / "no-such-data"), "--cache", str(tmp_path / "cache")])
    assert exit_info.value.code == 2 and not (tmp_path / "merged").exists()


def test_a_run_of_members_trains_each_seed_and_merges_them(shapes_model: ShapesModel, tmp_path: Path) -> None:
    """`members` > 1 (a variant's or `--members`): that many runs from consecutive seeds, each selected on the
    validation part, merged with each member thresholded apart into the one checkpoint a first start serves."""
    overrides = {"epochs": 12, "dense_epochs": 4, "anneal_epochs": 2, "batch_size": 20, "h": 32, "lr": 3e-3,
                 "eval_every": 4, "seed": 5, "selection": "val", "val_images": 12, "calibrate": 20}
    out = tmp_path / "pair"
    trained = train_on(make_run("paper", {**overrides, "members": 2}), shapes_model.data, out, shapes_model.cache,
                       ["--variant", "paper", "--members", "2"])
    merged = Checkpoint.load(trained.checkpoint)
    assert trained.checkpoint == out / "model.pt" and merged.blocks == 2 and merged.dim == 64
    first, second = (Checkpoint.load(out / f"member-{m}" / "model.pt") for m in (1, 2))
    assert (first.meta["train"]["seed"], second.meta["train"]["seed"]) == (5, 6) and first.dim == second.dim == 32
    # the second member is the run of seed 6 alone; the merged encoders are the members' side by side
    data = load_split_data(shapes_model.data, "train", first.image_cfg, shapes_model.cache, make_parser("spacy"))
    tr, val = split_for_selection(make_run("paper", overrides).train, data)
    train(make_run("paper", {**overrides, "seed": 6}), tr, val, tmp_path / "alone", shapes_model.cache)
    alone = Checkpoint.load(tmp_path / "alone" / "model.pt")
    for a, b in zip(second.model.state_dict().values(), alone.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    image = merged.model.image
    assert isinstance(image, torch.nn.Linear) and isinstance(first.model.image, torch.nn.Linear)
    torch.testing.assert_close(image.weight[:32], first.model.image.weight)
    # calibrated anew, selected and scaled on the validation part, recorded in one history
    assert merged.calibration is not None and merged.calibration.relevance is not None
    hist = json.loads((out / "history.json").read_text())
    assert hist["variant"] == "paper" and hist["blocks"] == 2 and set(hist["val"]) == {"member-1", "member-2", "merged"}
    assert hist["command"].endswith("--members 2") and hist["selection"]["rule"] == "val"
    member_epochs = [json.loads((out / f"member-{m}" / "history.json").read_text())["selection"]["epoch"]
                     for m in (1, 2)]
    assert list(trained.member_epochs) == hist["member_epochs"] == member_epochs, "each member's epoch kept"
    with pytest.raises(ValueError, match="at least 2"):
        train_members(make_run("paper", {**overrides, "members": 1}), tr, val, tmp_path / "one", shapes_model.cache)
    for variant, shape in (("two-branch", {}), ("paper", {"image_hidden": 8})):  # refused before any training
        with pytest.raises(ValueError, match="linear fragment models"):
            train_members(make_run(variant, {**overrides, "members": 2}, shape), tr, val, tmp_path / "no",
                          shapes_model.cache)
        assert not (tmp_path / "no").exists()
    # a first start's selection ("last", no validation part): merged and calibrated all the same
    last = {**overrides, "selection": "last", "epochs": 4, "members": 2}
    trained = train_on(make_run("paper", last), shapes_model.data, tmp_path / "last", shapes_model.cache, [])
    assert trained.selection == "last" and Bundle.load(trained.checkpoint).blocks == 2
    assert trained.member_epochs == (4, 4), "the last epoch of each member"
    label = selection_label(json.loads((tmp_path / "last" / "history.json").read_text()))
    assert label == "merge of 2 members, each fixed 4 epochs", "the results table's selection column"
    assert Bundle.load(trained.checkpoint).calibration is not None
