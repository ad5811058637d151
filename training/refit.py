"""What the commands that fit a part beside a trained model share (training.evidence, training.grounder, ...): the
model with its training images split into the part it was trained on and its validation part (their flags and
the loading: fragsearch/commands/refit.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fragsearch.model.bundle import Bundle
from fragsearch.model.dataset import SplitData
from fragsearch.model.entities import ImageEntities


@dataclass
class Refit:
    """The model, its training images split (`rest`: trained on; `val`: the validation part), where the Entities
    annotations are, and the command line to record."""

    bundle: Bundle
    rest: SplitData
    val: SplitData
    entities: Path
    command: str

    def all_entities(self) -> dict[str, ImageEntities]:
        """The Entities annotations of every training image (the part trained on and the validation part)."""
        from fragsearch.model.entities import read_entities

        return read_entities(self.entities, [*self.rest.names, *self.val.names])
