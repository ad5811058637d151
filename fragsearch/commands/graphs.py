"""Make the files the runtime reads from the trainer's side (torch): the backbone's ONNX graph and ImageNet head
arrays (training/nets/backbone.py), MiniLM's graph without its weights (training/nets/minilm.py).

    python -m fragsearch.training.nets.backbone --precision int8     # the served default's graph and head
    python -m fragsearch.training.nets.minilm                        # MiniLM's graph

Each is written into the graph folder of the settings in force (<cache>/graphs; --cache or --folder to name
another), where the runtime looks after the release folder. A file already there is kept.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from fragsearch.commands.flags import add_region_flags, add_setting_flags, settings_of
from fragsearch.model.config import BACKBONE_PRECISIONS
from fragsearch.model.graphs import BACKBONE_NAME

logger = logging.getLogger(__name__)


def _place_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--folder", type=Path, default=None,
                    help="where they are written (default: <cache>/graphs, the graph folder)")
    add_setting_flags(ap, ("cache",))


def backbone_main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    """The backbone's graph for one precision and its ImageNet head's arrays."""
    from fragsearch.training.nets.backbone import _efficientnet, export_head, onnx_graph

    ap = argparse.ArgumentParser(prog=prog, description="Make the backbone graph and head arrays the runtime reads.")
    ap.add_argument("--precision", choices=BACKBONE_PRECISIONS, default="int8", help="fp32, or the int8 graph")
    add_region_flags(ap, ("backbone",))
    ap.add_argument("--weights", default="", help="a fine-tuned backbone file (ImageConfig.backbone_weights)")
    _place_flags(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    places = settings_of(ap, args).places
    folder = args.folder or places.graphs
    backbone = args.backbone or BACKBONE_NAME
    net = _efficientnet(args.weights, backbone, places)
    graph = onnx_graph(args.precision, folder, net, args.weights, backbone, places)
    head = export_head(folder, net, args.weights, backbone, places)
    logger.info("%s\n%s", graph, head)


def minilm_main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    """MiniLM's graph (or its first layers')."""
    from fragsearch.training.nets.minilm import export_graph

    ap = argparse.ArgumentParser(prog=prog,
                                 description="Make MiniLM's graph (without its weights) that the runtime runs.")
    ap.add_argument("--upto", type=int, default=None,
                    help="only MiniLM's first UPTO layers (the graph a model that trains the others reads)")
    _place_flags(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    logger.info("%s", export_graph(args.folder or settings_of(ap, args).places.graphs, args.upto))
