"""The export step: the ONNX graphs and head arrays the runtime runs, made from the torch side (training/nets/) where
neither the release folder nor the run's graph folder has them. The runtime only looks them up (model/backbone.py
``backbone_graph``, model/minilm.py ``minilm_graph``: GraphMissing where they are not); what trains, fine-tunes,
releases or extracts with a model calls this first, and `python -m fragsearch.training.nets.backbone` /
`python -m fragsearch.training.nets.minilm` make one by hand."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from fragsearch.model.config import ImageConfig
from fragsearch.model.graphs import BACKBONE_NAME, find, graph_name, head_name
from fragsearch.model.image import extractor_graphs, reads_head
from fragsearch.model.minilm_files import graph_name as minilm_graph_name
from fragsearch.model.places import Places

logger = logging.getLogger(__name__)


def make_graphs(cfg: ImageConfig | None, places: Places, minilm: Iterable[int | None] = (), head: bool = False
                ) -> list[Path]:
    """Make what is missing of the files a RegionExtractor of ``cfg`` reads (its backbone graphs and the ImageNet
    head's arrays; None: no image side), of the head with `head`, and of MiniLM's graphs (`minilm`:
    None the whole transformer, an int its first that many layers), in ``places.graphs``; the files made."""
    made: list[Path] = []
    for precision, backbone, weights in extractor_graphs(cfg) if cfg is not None else ():
        if find(graph_name(precision, backbone, weights, places), places.graphs) is None:
            from fragsearch.training.nets.backbone import onnx_graph

            made.append(onnx_graph(precision, places.graphs, weights=weights, backbone=backbone, places=places))
    if (head or cfg is not None and reads_head(cfg)) and find(head_name(BACKBONE_NAME, "", places),
                                                            places.graphs) is None:
        from fragsearch.training.nets.backbone import export_head

        made.append(export_head(places.graphs, places=places))
    for upto in minilm:
        if find(minilm_graph_name(upto), places.graphs) is None:
            from fragsearch.training.nets.minilm import export_graph

            made.append(export_graph(places.graphs, upto))
    for path in made:
        logger.info("made %s", path)
    return made
