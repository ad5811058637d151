"""Every command-line flag of the project's commands says what it does (--help)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

import pytest

COMMANDS = ["fragsearch.commands.train", "fragsearch.commands.extract", "fragsearch.commands.data",
            "fragsearch.commands.calibrate", "fragsearch.commands.evaluate", "fragsearch.commands.finetune",
            "fragsearch.commands.merge", "fragsearch.commands.cutpoint", "fragsearch.commands.evidence",
            "fragsearch.commands.grounder", "fragsearch.commands.presence", "fragsearch.commands.regions",
            "fragsearch.commands.index_build", "fragsearch.commands.options", "fragsearch.commands.prepare",
            "fragsearch.commands.index_sync", "fragsearch.commands.index_bulk", "fragsearch.commands.serve",
            "bench.index_bench",
            "bench.query_bench", "bench.product_shapes", "bench.extract_bench", "bench.load_bench", "bench.soak_bench",
            "bench.report",
            "bench.channels",
            "bench.similar_bench", "bench.alignment", "bench.bulk_bench", "bench.ensemble", "bench.backbone_rate",
            "bench.relevance_bench", "bench.duplicates_bench", "fragsearch.commands.duplicates",
            "fragsearch.commands.release",
            "bench.first_start", "bench.feature_paths", "bench.serve_memory", "bench.photo_decode", "bench.runtime_ab",
            "bench.phrase_evidence", "bench.evidence_ceiling", "bench.grounding", "bench.backbone_lite",
            "bench.detector_paths", "bench.million", "bench.region_cost", "bench.parse_processes",
            "bench.relevance_sizes", "bench.rerank_bench", "bench.serve_large", "bench.text_cost", "bench.train_step",
            "bench.page_read", "bench.profile_breakdown", "bench.candidate_copy", "bench.text_passes",
            "bench.coded_references",
            "fragsearch.commands.graphs:backbone_main", "fragsearch.commands.graphs:minilm_main",
            "fragsearch.commands.api_docs"]


class Captured(Exception):
    pass


def parser_of(module: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser a command's main() builds, taken when it parses (nothing else of main runs)."""
    seen: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        seen.append(self)
        raise Captured

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    name, _, function = module.partition(":")  # "module:function" where a module holds several commands
    main: Callable[..., Any] = getattr(importlib.import_module(name), function or "main")
    with pytest.raises(Captured):
        main([])
    return seen[0]


@pytest.mark.parametrize("module", COMMANDS)
def test_every_flag_has_help(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = parser_of(module, monkeypatch)
    silent = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
              if not isinstance(a, argparse._HelpAction | argparse._VersionAction) and not (a.help or "").strip()]
    assert not silent, f"{module}: flags without help: {', '.join(silent)}"
