"""A model's own top layers of MiniLM (ModelConfig.text_layers, model/textlayers.py): the runtime's NumPy layers
and the trainer's torch twin give the same numbers; at MiniLM's own weights they give MiniLM's vectors; the
trainer's batch pool is the runtime's vectors of the same sentences; a model trains them, saves them and
serves with them; a run of members trains one set, read fixed by the members after the first, and merges
it; a teacher refuses them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import load_split_data
from fragsearch.model.encoders import Encoders, ModelConfig
from fragsearch.model.fragments import SENTENCE_REL, TextPipeline
from fragsearch.model.minilm import minilm
from fragsearch.model.parsers import make_parser
from fragsearch.model.places import Places
from fragsearch.model.textlayers import PREFIX, TextLayers, first_layer
from fragsearch.model.words import cut_hidden, encode_texts, encode_tuned
from fragsearch.training.epochs import FragmentBatches
from fragsearch.training.evaluate import evaluate
from fragsearch.training.graphs import make_graphs
from fragsearch.training.nets.checkpoint import Checkpoint
from fragsearch.training.nets.encoders import FragmentModel, arrays
from fragsearch.training.nets.textlayers import TextLayers as TorchLayers
from fragsearch.training.release import manifest_of, write_release
from fragsearch.training.train import Run, make_run, train
from tests.conftest import ShapesModel

LISTS = [["a", "dog", "runs", "through", "the", "grass"], ["two", "men"], ["a", "skateboarder", "jumps"],
         ["unbelievably", "colourful", "parrots", "squawk"]]


def _minilm_layers(n: int) -> TorchLayers:
    return TorchLayers(n).load_minilm().eval()


def _numpy(layers: TorchLayers) -> TextLayers:
    return TextLayers.from_arrays({f"text_layers.{k}": v for k, v in arrays(layers).items()}, len(layers.layers))


@pytest.mark.parametrize("n", [0, 7])
def test_a_count_of_layers_outside_minilms_is_refused(n: int) -> None:
    with pytest.raises(ValueError, match="between 1 and 6"):
        first_layer(n)


def test_minilm_with_a_models_layers_gives_the_torch_twins_numbers_with_padding() -> None:
    torch.manual_seed(0)
    layers = _minilm_layers(2)
    for p in layers.parameters():  # away from MiniLM's weights: any weights agree
        p.data.add_(0.02 * torch.randn_like(p))
    make_graphs(None, Places(), [layers.first])  # the export step of the cut graph (the trainer's, epochs.py)
    hidden, offsets, _ = cut_hidden(LISTS, layers.first)  # what the trainer's twin reads
    lens = np.diff(offsets)
    x = torch.zeros(len(LISTS), int(lens.max()), 384)
    mask = torch.zeros(len(LISTS), int(lens.max()), dtype=torch.long)
    for k, n in enumerate(lens):
        x[k, :n] = torch.from_numpy(hidden[offsets[k] : offsets[k + 1]])
        mask[k, :n] = 1
    with torch.no_grad():
        want = layers(x, mask).numpy()
    model = minilm(layers=_numpy(layers))  # MiniLM's graph, the layers' weights in place of the package's
    got: dict[int, np.ndarray] = {}
    model.each_hidden(model.word_pieces(LISTS), got.__setitem__)
    assert sorted(got) == list(range(len(LISTS)))
    for k, n in enumerate(lens):
        np.testing.assert_allclose(got[k], want[k, :n], rtol=1e-4, atol=1e-4)
    plain = {}
    minilm().each_hidden(minilm().word_pieces(LISTS), plain.__setitem__)
    assert not np.allclose(plain[0], got[0], atol=1e-2)  # not the package's own layers


@pytest.mark.parametrize("n", [1, 2, 6])
def test_minilms_own_layers_after_the_cut_give_minilms_vectors(n: int) -> None:
    words, sent = encode_tuned(LISTS, _numpy(_minilm_layers(n)))
    frozen, _ = encode_texts(None, LISTS, contextual=True, whole=False)
    for got, want in zip(words, frozen, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-4)
    # the sentence vector: the mean over the one pass of the words, [CLS] and [SEP] included
    model = minilm()
    pieces = model.word_pieces(LISTS)
    for k, p in enumerate(pieces):
        hidden = model.hidden(p.ids[None], np.ones((1, len(p)), np.int64))[0]
        want = hidden.mean(axis=0) / np.linalg.norm(hidden.mean(axis=0))
        np.testing.assert_allclose(sent[k], want, atol=2e-4)


def test_the_cut_graph_is_minilms_hidden_states_after_that_layer() -> None:
    from fragsearch.training.nets.minilm import bert

    make_graphs(None, Places(), [4])  # the export step: the runtime only looks the cut graph up
    hidden, offsets, words = cut_hidden(LISTS[:2], 4)
    model = bert()
    p = minilm().word_pieces(LISTS[:1])[0]
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(p.ids[None]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    output_hidden_states=True).hidden_states[4][0].numpy()
    np.testing.assert_allclose(hidden[offsets[0] : offsets[1]], out, atol=1e-4)
    assert offsets[-1] == len(hidden) == len(words)
    assert words[0] == -1 and words[offsets[1] - 1] == -1  # [CLS] ... [SEP]


def _tuned_run(shapes_model: ShapesModel, n: int, **train: object) -> Run:
    run = make_run("contextual", {"epochs": 2, "dense_epochs": 1, "anneal_epochs": 1, "batch_size": 20, "h": 32,
                                  "lr": 3e-3, "text_lr": 1e-3, "eval_every": 0, "calibrate": 20, **train},
                   {"text_layers": n})
    return dataclasses.replace(run, image=shapes_model.bundle.image_cfg,
                               text=dataclasses.replace(run.text, sentence_fragment=True))


def test_the_trainers_batch_pool_is_the_runtimes_vectors(shapes_model: ShapesModel, tmp_path: Path) -> None:
    run = _tuned_run(shapes_model, 1)
    data = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, make_parser("spacy"))
    text = TextPipeline.fit(run.text, data.parsed, shapes_model.cache / "words")
    sid = text.relations.index(SENTENCE_REL)
    assert sid is not None
    cfg = ModelConfig(h=16, n_relations=len(text.relations), img_dim=data.feats.shape[-1], sentence_relation=sid,
                      text_layers=1)
    model = FragmentModel(cfg)
    assert model.text_layers is not None
    model.text_layers.load_minilm()
    torch.manual_seed(1)
    for p in model.text_layers.parameters():  # trained away from MiniLM's weights
        p.data.add_(0.002 * torch.randn_like(p))
    model.eval()
    batches = FragmentBatches(text, data, 0.5, "cpu", model.text_layers.first, tmp_path)
    assert batches.tuned is not None
    idx = np.array([3, 0, 17, 8, 11])
    rel, a, b, mask = batches.sentences(idx, np.random.default_rng(0))  # half of them in their unigram form
    with torch.no_grad():
        pool, sa, sb = batches.tuned.pool(model.text_layers, idx, a, b, mask)
    text.use_layers(Encoders(cfg, arrays(model)).text_layers)
    ctx, sent = text.frozen_vectors([data.parsed[i] for i in idx], [data.sentences[i] for i in idx])
    assert sent is not None
    want = np.concatenate([np.concatenate([c, s[None]]) for c, s in zip(ctx, sent, strict=True)])
    np.testing.assert_allclose(pool.numpy(), want, atol=2e-4)
    # every fragment reads the word or sentence it read in the frozen pool, now through the layers (close to
    # MiniLM's own vectors: the layers moved a little), and padding reads row 0
    frozen = batches.pool.numpy()
    m = mask.numpy() > 0
    for ids, tuned in ((a, sa), (b, sb)):
        got, was = pool.numpy()[tuned.numpy()[m]], frozen[ids.numpy()[m]]
        cos = (got * was).sum(1)
        assert cos.min() > 0.97, cos
        assert (got @ was.T).diagonal().mean() > np.median(got @ was.T) + 0.1  # not any row
        assert tuned.numpy()[~m].max(initial=0) == 0


def test_a_model_trains_its_layers_saves_them_and_serves_with_them(shapes_model: ShapesModel, tmp_path: Path
                                                                   ) -> None:
    run = _tuned_run(shapes_model, 1)
    data = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, make_parser("spacy"))
    train(run, data, None, tmp_path / "model", shapes_model.cache)
    bundle = Bundle.load(tmp_path / "model" / "model.pt")
    layers = bundle.text.layers
    assert layers is not None and layers.first == 5
    minilms = _numpy(_minilm_layers(1))
    assert not np.allclose(layers.weights[0]["q.weight"], minilms.weights[0]["q.weight"])  # trained
    assert f"{PREFIX}.0.q.weight" in bundle.encoders.arrays()
    release = tmp_path / "release"  # a release ships MiniLM's graph: the model's layers run in it
    files = write_release(bundle, release, manifest_of(bundle, tmp_path / "model" / "model.pt", shapes_model.data,
                                                       {"rsum": 1.0},
                                                       "python -m fragsearch.training.release x"))["files"]
    assert "minilm-l6-fp32-opset17-noweights.onnx" in files
    assert not any("upto" in f for f in files)  # no graph cut below them
    served = Bundle.load(release)
    assert served.text.layers is not None and served.text.layers.digest == layers.digest
    enc = served.text.encode(["a red circle beside a blue square"])
    want, _ = encode_tuned([["a", "red", "circle", "beside", "a", "blue", "square"]], layers)
    np.testing.assert_allclose(enc.extra[:7], want[0], atol=1e-5)
    frozen, _ = encode_texts(None, [["a", "red", "circle", "beside", "a", "blue", "square"]], whole=False)
    assert not np.allclose(enc.extra[:7], frozen[0], atol=1e-3)  # not MiniLM's own vectors
    metrics = evaluate(served, shapes_model.dev)
    assert metrics == evaluate(bundle, shapes_model.dev)
    assert 0 <= metrics["search_r1"] <= 100


def test_a_checkpoint_reads_through_its_layers_as_they_are_now(shapes_model: ShapesModel, tmp_path: Path) -> None:
    """The trainer's and the calibration's Checkpoint: its first encoding after loading reads through the model's
    layers (not MiniLM's own vectors), and one after the layers were trained further reads the new weights."""
    run = _tuned_run(shapes_model, 1)
    data = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, make_parser("spacy"))
    train(run, data, None, tmp_path / "model", shapes_model.cache)
    words = [["a", "red", "circle", "beside", "a", "blue", "square"]]
    ckpt = Checkpoint.load(tmp_path / "model" / "model.pt", device="cpu")
    first = ckpt.text.encode(["a red circle beside a blue square"]).extra[:7].copy()
    layers = Bundle.load(tmp_path / "model" / "model.pt").text.layers
    assert layers is not None
    np.testing.assert_allclose(first, encode_tuned(words, layers)[0][0], atol=1e-5)
    model = ckpt.model
    assert isinstance(model, FragmentModel) and model.text_layers is not None
    with torch.no_grad():
        for p in model.text_layers.parameters():  # an optimiser step, in place
            p.add_(0.01 * torch.randn_like(p))
    moved = ckpt.text.encode(["a red circle beside a blue square"]).extra[:7]
    assert not np.allclose(moved, first, atol=1e-3)
    np.testing.assert_allclose(moved, encode_tuned(words, ckpt.bundle().encoders.text_layers)[0][0], atol=1e-5)


def test_a_frozen_models_vectors_are_not_read_through_anothers_layers(shapes_model: ShapesModel) -> None:
    shapes = shapes_model.bundle.text
    text = TextPipeline(dataclasses.replace(shapes.cfg, word_vectors="contextual"), shapes.relations, shapes.words)
    parsed = shapes.parse(["a red circle"])
    before = text.frozen_vectors(parsed, ["a red circle"])[0][0].copy()
    layers = _numpy(_minilm_layers(1))
    for w in layers.weights[0].values():
        w += 0.01
    text.use_layers(TextLayers(layers.first, layers.weights))
    try:
        assert not np.allclose(text.frozen_vectors(parsed, ["a red circle"])[0][0], before, atol=1e-3)
    finally:
        text.use_layers(None)
    np.testing.assert_array_equal(text.frozen_vectors(parsed, ["a red circle"])[0][0], before)


def test_members_with_layers_of_their_own_merge_only_one_set(tmp_path: Path) -> None:
    from fragsearch.training.merge import merge_models

    cfg = ModelConfig(img_dim=10, word_dim=384, h=8, text_layers=1)
    a, b = FragmentModel(cfg), FragmentModel(cfg)
    assert a.text_layers is not None and b.text_layers is not None
    a.text_layers.load_minilm()
    b.text_layers.load_minilm()
    with torch.no_grad():
        next(iter(b.text_layers.parameters())).add_(0.01)
    with pytest.raises(ValueError, match="one set"):
        merge_models([a, b])
    b.text_layers.load_state_dict(a.text_layers.state_dict())
    merged = merge_models([a, b])
    assert merged.cfg.text_layers == 1 and merged.cfg.blocks == 2 and merged.text_layers is not None
    for k, v in a.text_layers.state_dict().items():
        assert torch.equal(merged.text_layers.state_dict()[k], v)
    plain = ModelConfig(img_dim=10, word_dim=384, h=8)
    with pytest.raises(ValueError, match="differ in shape|one set"):
        merge_models([a, FragmentModel(plain)])


def test_a_run_of_members_trains_one_set_of_layers_the_others_read_it_fixed(shapes_model: ShapesModel,
                                                                           tmp_path: Path) -> None:
    from fragsearch.training.train import train_members

    run = _tuned_run(shapes_model, 1, members=2)
    data = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, make_parser("spacy"))
    summary = train_members(run, data, None, tmp_path / "run", shapes_model.cache)
    assert summary["member_epochs"] == [2, 2]
    first, second = (Checkpoint.load(tmp_path / "run" / f"member-{m}" / "model.pt") for m in (1, 2))
    assert second.meta["train"]["text_from"] == str(tmp_path / "run" / "member-1" / "model.pt")
    assert first.meta["train"]["text_from"] == ""
    minilms = _numpy(_minilm_layers(1))
    one, two = first.text.layers, second.text.layers
    assert one is not None and two is not None
    assert not np.allclose(one.weights[0]["q.weight"], minilms.weights[0]["q.weight"])  # the first trained them
    assert two.digest == one.digest  # the second read them as they are, untrained
    w1, w2 = arrays(first.model), arrays(second.model)
    assert not np.allclose(w1["image.weight"], w2["image.weight"])  # its own encoders, trained
    merged = Bundle.load(tmp_path / "run" / "model.pt")
    assert merged.text.layers is not None and merged.text.layers.digest == one.digest
    assert merged.encoders.cfg.blocks == 2 and merged.encoders.cfg.text_layers == 1
    # the merged score is the members' scores summed block by block, every caption read through the one set
    sentences = shapes_model.dev.sentences[:6]
    img = shapes_model.dev.feats[:5]
    total = np.zeros((len(img), len(sentences)))
    for member in (first.bundle(), second.bundle()):
        v = member.embed_images(img, calibrated=False)
        s, sm = member.embed_sentences(member.text.encode(sentences), calibrated=False)
        total += member.scores(v, np.ones(v.shape[:2], np.float32), s, sm)
    v = merged.embed_images(img, calibrated=False)
    s, sm = merged.embed_sentences(merged.text.encode(sentences), calibrated=False)
    np.testing.assert_allclose(merged.scores(v, np.ones(v.shape[:2], np.float32), s, sm), total, atol=1e-4)


def test_text_from_is_refused_without_layers_or_beside_a_teacher(shapes_model: ShapesModel, tmp_path: Path) -> None:
    """A model to read layers from must have them, as many as asked; a student reading fixed layers takes no
    teacher, and a teacher with layers of its own is refused (a teacher reads MiniLM's own vectors)."""
    from fragsearch.training.distill import Teacher
    from fragsearch.training.train import fixed_text_layers

    run = _tuned_run(shapes_model, 1, text_from=str(shapes_model.model_path))
    with pytest.raises(ValueError, match="no MiniLM layers of its own"):
        fixed_text_layers(run.train, run)
    data = load_split_data(shapes_model.data, "train", run.image, shapes_model.cache, make_parser("spacy"))
    train(_tuned_run(shapes_model, 1), data, None, tmp_path / "model", shapes_model.cache)
    src = str(tmp_path / "model" / "model.pt")
    run = _tuned_run(shapes_model, 2, text_from=src)
    with pytest.raises(ValueError, match="asks for 2"):
        fixed_text_layers(run.train, run)
    run = _tuned_run(shapes_model, 1, text_from=src, distill_from=str(shapes_model.model_path))
    with pytest.raises(ValueError, match="teacher"):
        fixed_text_layers(run.train, run)
    text = TextPipeline.fit(run.text, data.parsed, shapes_model.cache / "words")
    with pytest.raises(ValueError, match="its own MiniLM layers"):
        Teacher(Path(src), text, run.image, torch.from_numpy(data.feats), "cpu")

