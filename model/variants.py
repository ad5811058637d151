"""Named variants (the rows of docs/results) as data: one TOML file each under model/variants/.

A variant file is the image of a dict {"model": {...}, "text": {...}, "image": {...}, "train": {...}}:
one table per settings group, each holding only the fields it changes from their defaults
(`ModelConfig` shapes, `TextConfig`, `ImageConfig`, `TrainConfig`), plus two optional top-level
keys: `base`, the variant it extends (its settings first, then this file's, field by field; a base
names no base of its own, so a variant reads whole in one file, or in its file and its base's), and
`description`, one line for `python -m fragsearch.training.train --list`. Every field is described in
model/variants/README.md. A `model.h` sets the embedding size (`train.h` follows it).

The trainer, the service's preparation and the report read variants here; nothing in this module
trains.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fragsearch.model.config import ImageConfig, TextConfig, TrainConfig
from fragsearch.model.encoders import ModelConfig

VARIANTS_DIR = Path(__file__).resolve().parent / "variants"
SECTIONS = ("model", "text", "image", "train")
# ModelConfig fields a variant may set (the others follow from the data: img_dim, word_dim, n_relations,
# sentence_relation); the shape options are also trainer flags of the same name
MODEL_SHAPE: dict[str, type] = {"image_hidden": int, "global_hidden": int, "dropout": float, "input_dropout": float,
                                 "pool_ranks": int, "text_layers": int}
MODEL_FIELDS: dict[str, type] = {"kind": str, "h": int, **MODEL_SHAPE}
_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


class VariantError(ValueError):
    """A variant is unknown, or its file is malformed (unknown field, wrong type, a base cycle)."""


def _field_types(cls: type) -> dict[str, type]:
    return {f.name: _TYPES[str(f.type)] for f in fields(cls)}


FIELD_TYPES: dict[str, dict[str, type]] = {"model": MODEL_FIELDS, "text": _field_types(TextConfig),
                                           "image": _field_types(ImageConfig), "train": _field_types(TrainConfig)}


@dataclass(frozen=True)
class Variant:
    """A resolved variant: `settings` is its dict image with the base chain applied (section -> field -> value)."""

    name: str
    description: str
    base: str | None
    settings: dict[str, dict[str, Any]]

    @property
    def text(self) -> TextConfig:
        return TextConfig(**self.settings["text"])

    @property
    def image(self) -> ImageConfig:
        return ImageConfig(**self.settings["image"])

    @property
    def model(self) -> dict[str, Any]:
        """The ModelConfig fields the variant sets (kind, h, shape options)."""
        return dict(self.settings["model"])

    @property
    def model_kind(self) -> str:
        return str(self.settings["model"].get("kind", "fragment"))

    @property
    def train(self) -> TrainConfig:
        cfg = TrainConfig(**self.settings["train"])
        h = self.settings["model"].get("h")
        return cfg if h is None else dataclasses.replace(cfg, h=h)

    def resolved(self) -> dict[str, dict[str, Any]]:
        """Every field a variant may set, as this one resolves it (section -> field -> value): the model's
        kind and shape options at ModelConfig's defaults unless set, its h the embedding size (train.h)."""
        shape = ModelConfig()
        model = {"kind": self.model_kind, "h": self.train.h, **{k: getattr(shape, k) for k in MODEL_SHAPE}}
        return {"model": {**model, **self.model}, "text": dataclasses.asdict(self.text),
                "image": dataclasses.asdict(self.image), "train": dataclasses.asdict(self.train)}


def variant_names(folder: Path = VARIANTS_DIR) -> list[str]:
    """The variants in `folder`, sorted."""
    return sorted(p.stem for p in folder.glob("*.toml"))


def _check_value(path: Path, section: str, key: str, value: Any) -> Any:
    types = FIELD_TYPES[section]
    if key not in types:
        raise VariantError(f"{path}: [{section}] has no field {key!r} (fields: {', '.join(types)})")
    want = types[key]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise VariantError(f"{path}: [{section}] {key} = {value!r} is not of type {want.__name__}")
    return value


def read_variant_file(path: Path) -> tuple[str | None, str, dict[str, dict[str, Any]]]:
    """(base, description, the file's own settings per section), checked against the settings' fields."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise VariantError(f"cannot read variant file {path}: {exc}") from exc
    extra = set(raw) - {"base", "description", *SECTIONS}
    if extra:
        raise VariantError(f"{path}: unknown keys {sorted(extra)} (base, description, {', '.join(SECTIONS)})")
    base, description = raw.get("base"), raw.get("description", "")
    if not (base is None or isinstance(base, str)) or not isinstance(description, str):
        raise VariantError(f"{path}: base and description are strings")
    own: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        table = raw.get(section, {})
        if not isinstance(table, dict):
            raise VariantError(f"{path}: {section} must be a table ([{section}])")
        own[section] = {k: _check_value(path, section, k, v) for k, v in table.items()}
    if "h" in own["model"] and own["train"].get("h", own["model"]["h"]) != own["model"]["h"]:
        raise VariantError(f"{path}: model.h and train.h differ (model.h sets the embedding size)")
    return base, description, own


def _read_named(name: str, folder: Path, extended_by: str | None) -> tuple[str | None, str, dict[str, dict[str, Any]]]:
    """`read_variant_file` of the variant `name` (VariantError naming the variant that extends it when unknown)."""
    path = folder / f"{name}.toml"
    if not path.is_file():
        where = "" if extended_by is None else f" (the base of {extended_by!r})"
        raise VariantError(f"unknown variant {name!r}{where}: one of {', '.join(variant_names(folder))}")
    return read_variant_file(path)


def load_variant(name: str, folder: Path = VARIANTS_DIR) -> Variant:
    """The variant `name`: its file's settings over its base's, when it names one (a base extends nothing,
    so every variant reads whole in its file and at most one other); VariantError when unknown or malformed."""
    base, description, own = _read_named(name, folder, None)
    layers = [own]
    if base is not None:
        base_base, _, base_own = _read_named(base, folder, name)
        if base_base is not None:
            if base_base == name:
                raise VariantError(f"variant {name!r}: base cycle {name} -> {base} -> {name}")
            raise VariantError(f"variant {name!r}: its base {base!r} extends {base_base!r} (a base extends "
                               "nothing: write the settings out in one of them)")
        layers.insert(0, base_own)
    settings: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for layer in layers:
        for section in SECTIONS:
            settings[section].update(layer[section])
    return Variant(name, description, base, settings)


def field_meanings(section: str, folder: Path = VARIANTS_DIR) -> dict[str, str]:
    """What each field of a settings group ("model", "text", "image", "train") means: the table of
    model/variants/README.md, the one place fields are described (command-line help reads it)."""
    readme = folder / "README.md"
    if not readme.is_file():
        return {}
    parts = readme.read_text(encoding="utf-8").split(f"## `[{section}]`", 1)
    if len(parts) < 2:
        return {}
    body = parts[1].split("\n## ", 1)[0]
    return {name: meaning.strip()
            for name, meaning in re.findall(r"^\| `(\w+)` \| \w+ \| [^|]+ \| (\S[^|]*) \|$", body, flags=re.M)}
