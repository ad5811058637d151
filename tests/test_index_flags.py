"""The index commands' settings flags are made from IndexShape and SearchSettings (fragsearch/commands/flags.py):
one flag a field, with its default, type and choices, read back as the same IndexSettings."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from fragsearch.commands.flags import add_index_flags, index_settings_of
from fragsearch.index.sentences import DEFAULT_SETTINGS as SENTENCE_DEFAULTS
from fragsearch.index.types import IndexSettings, IndexShape, SearchSettings


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="t")
    add_index_flags(ap, IndexSettings())
    add_index_flags(ap, SENTENCE_DEFAULTS, ("k_prime", "rerank"), prefix="sentence-", what="sentence index: ")
    return ap


def test_every_field_has_its_flag_and_the_defaults_read_back_as_the_defaults() -> None:
    ap = _parser()
    flags = {o for a in ap._actions for o in a.option_strings}
    fields = [f.name for t in (IndexShape, SearchSettings) for f in dataclasses.fields(t)]
    assert {f"--{name.replace('_', '-')}" for name in fields} <= flags
    assert {"--sentence-k-prime", "--sentence-rerank"} <= flags
    args = ap.parse_args([])
    assert index_settings_of(args, IndexSettings()) == IndexSettings()
    sentences = index_settings_of(args, IndexSettings(), prefix="sentence-")
    assert (sentences.search.k_prime, sentences.search.rerank) == (SENTENCE_DEFAULTS.search.k_prime,
                                                                   SENTENCE_DEFAULTS.search.rerank)


def test_flags_set_their_fields_and_bad_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    ap = _parser()
    args = ap.parse_args(["--kind", "ivf", "--nlist", "64", "--store-dtype", "float16", "--k-prime", "7",
                          "--use-gpu", "--pretransform", "PCA64", "--sentence-rerank", "5"])
    images = index_settings_of(args, IndexSettings())
    assert images == IndexSettings.of(kind="ivf", nlist=64, store_dtype="float16", k_prime=7, use_gpu=True,
                                      pretransform="PCA64")
    sentences = index_settings_of(args, images, prefix="sentence-")
    assert sentences.search.rerank == 5 and sentences.search.k_prime == SENTENCE_DEFAULTS.search.k_prime
    assert sentences.shape == images.shape
    for bad in (["--kind", "lsh"], ["--store-dtype", "int4"], ["--nlist", "many"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
        assert "invalid" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nlist must be a positive integer"):
        index_settings_of(ap.parse_args(["--nlist", "0"]), IndexSettings())
