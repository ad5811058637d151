"""Command-line flags made from the settings' fields, by one generator (`add_field_flag`).

- The settings (fragsearch/settings.py `Settings`): `add_setting_flags` gives a command the flags of the settings it
  reads, by concern, each unset unless given, read back over the environment, `.env` and the settings file by
  `settings_of`.
- The index settings, from the fields of `IndexShape` and `SearchSettings` (their defaults, types, choices and
  help): one `--name` a field (`--k-prime`, `--store-dtype`, ...), read back as `IndexSettings`. A flag set with a
  prefix (`--sentence-k-prime`) sets the same field of a second index's settings.
- The image fragments' settings (`ImageConfig`): `--region-features`, `--crop-size`, ..., each overriding a
  variant's only where given (`with_region_flags`).

A field's flag is `--kebab-case` of its name; its type says the rest: a boolean is `--x / --no-x`, a `Literal` or
a field's `choices` the words it takes, a list a flag given once per value. Each flag made here carries the
field it was made from (`FIELD`), which tests/test_door.py checks for every flag of every command named like a
field.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from pydantic import SecretStr

from fragsearch.index.types import SAVED_ORDER, IndexSettings, IndexShape, SearchSettings
from fragsearch.model.config import ImageConfig
from fragsearch.settings import (
    CONCERN_TEXT,
    CONCERNS,
    CONFIG_FILE,
    Settings,
    SettingsFileError,
    concern_of,
    config_named,
    settings_error_line,
)

FIELD = "field"  # the attribute of a flag's action naming the field it was made from ("Settings.cache", ...)


def _kind(annotation: Any) -> tuple[Any, dict[str, Any]]:
    """The argparse keywords of a field's type: its converter, and choices, list and boolean forms."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if annotation is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is Literal:
        return None, {"choices": list(typing.get_args(annotation))}
    if typing.get_origin(annotation) is list:
        return None, {"action": "append", "metavar": "VALUE"}
    if annotation is SecretStr:
        return str, {}
    return annotation, {}


TRUE_WORDS, FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def bool_flag(text: str) -> bool:
    """A boolean flag's value: true/false (yes/no, on/off, 1/0); anything else is refused, never read as False."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false (also yes/no, on/off, 1/0)")


def add_field_flag(group: argparse._ArgumentGroup, field: str, annotation: Any, *, help: str, default: Any = None,
                   choices: Sequence[Any] | None = None, prefix: str = "", dest: str | None = None,
                   metavar: str | None = None, made_from: str = "", boolean_value: bool = False) -> argparse.Action:
    """The one generator: the flag of a field named `field` of type `annotation` (``--<prefix><field>``, dashes for
    underscores), into `dest`, with `help`, `default` and `choices` (or its type's). A boolean is `--x / --no-x`,
    or with `boolean_value` a flag taking true or false (`bool_flag`: the trainer's, as a variant's TOML writes
    it)."""
    converter, extra = _kind(annotation)
    if boolean_value and extra.get("action") is argparse.BooleanOptionalAction:
        converter, extra = bool_flag, {}
    if choices:
        extra["choices"] = list(choices)
    if converter is not None:
        extra["type"] = converter
        extra.setdefault("metavar", None if "choices" in extra else metavar or field.upper())
    action = group.add_argument(f"--{prefix}{field.replace('_', '-')}", dest=dest or field, default=default,
                                help=help, **extra)
    setattr(action, FIELD, made_from or field)
    return action


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# -- the settings


def add_setting_flags(ap: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """A flag for each named setting (its description is its help; a list setting's flag repeats), in a group per
    concern (`CONCERNS`), and --config. Unset flags leave the setting to the environment, .env, the settings file
    and its default; `settings_of` reads the parsed flags back into the one settings object."""
    if not any("--config" in a.option_strings for a in ap._actions):
        ap.add_argument_group("settings file").add_argument(
            "--config", type=Path, default=None, metavar="FILE",
            help=f"TOML settings file (default: FRAGSEARCH_CONFIG, else ./{CONFIG_FILE} where it exists); each "
                 "setting below is also read from FRAGSEARCH_<NAME>, .env and that file "
                 "(docs/operations/settings.md)")
    hints = _hints(Settings)
    for concern in CONCERNS:
        mine = [name for name in names if concern_of(name) == concern]
        if not mine:
            continue
        group = ap.add_argument_group(f"{concern} settings", CONCERN_TEXT[concern])
        for name in mine:
            field = Settings.model_fields[name]
            add_field_flag(group, name, hints[name], help=f"{field.description} (FRAGSEARCH_{name.upper()})",
                           dest=f"setting_{name}", metavar=name.split("_")[-1].upper(), made_from=f"Settings.{name}")
    ap.set_defaults(setting_names=[*(ap.get_default("setting_names") or []), *names])


def settings_of(ap: argparse.ArgumentParser, args: argparse.Namespace, **fixed: Any) -> Settings:
    """The settings of a command line: the flags `add_setting_flags` made (and `fixed` values, e.g. a folder
    named as an argument) over the environment, .env, the settings file and the defaults. A bad value or
    settings file exits like a bad flag (status 2), with one line: `bad_setting`."""
    given = {name: getattr(args, f"setting_{name}") for name in getattr(args, "setting_names", ())
             if getattr(args, f"setting_{name}", None) is not None}
    with config_named(getattr(args, "config", None)):
        try:
            return Settings(**{**given, **fixed})
        except (SettingsFileError, ValueError) as e:
            bad_setting(ap, e)


def bad_setting(ap: argparse.ArgumentParser, e: Exception) -> NoReturn:
    """Exit with status 2 (a usage error, as argparse's) and one line naming the setting at fault."""
    flags = [option for action in ap._actions for option in action.option_strings]
    ap.exit(2, f"{ap.prog}: error: {settings_error_line(e, flags)}\n")


# -- the index settings


def _index_fields() -> dict[str, dataclasses.Field[object]]:
    both = {f.name: f for f in (*dataclasses.fields(IndexShape), *dataclasses.fields(SearchSettings))}
    return {name: both[name] for name in SAVED_ORDER}


def _index_dest(prefix: str, name: str) -> str:
    return f"index_{prefix.replace('-', '_')}{name}"


def add_index_flags(ap: argparse.ArgumentParser, defaults: IndexSettings, names: Iterable[str] | None = None,
                    prefix: str = "", what: str = "") -> None:
    """One flag per field named (default: every field of both types) with `defaults`' values; `prefix`
    ("sentence-") and `what` ("sentence index: ") for a second index's flags."""
    fields = _index_fields()
    hints = {**_hints(IndexShape), **_hints(SearchSettings)}
    values = defaults.to_dict()
    group = ap.add_argument_group(f"{what.rstrip(': ') or 'index'} shape and search (IndexShape: saved with the "
                                  "index, a rebuild to change; SearchSettings: per search)")
    for name in fields if names is None else names:
        f = fields[name]
        default = values[name]
        text = f"{what}{f.metadata['help']}"
        add_field_flag(group, name, hints[name], help=text if isinstance(default, bool) else f"{text} (default "
                       f"{default!r})", default=default, choices=f.metadata["choices"], prefix=prefix,
                       dest=_index_dest(prefix, name), made_from=f"{_owner(name)}.{name}")


def _owner(name: str) -> str:
    return "IndexShape" if name in {f.name for f in dataclasses.fields(IndexShape)} else "SearchSettings"


def index_settings_of(args: argparse.Namespace, base: IndexSettings, prefix: str = "") -> IndexSettings:
    """`base` with every field whose flag `add_index_flags` added (with `prefix`) set from `args`."""
    values = base.to_dict()
    for name in values:
        dest = _index_dest(prefix, name)
        if hasattr(args, dest):
            values[name] = getattr(args, dest)
    return IndexSettings.of(**values)


# -- the image fragments' settings

REGION_FLAGS = ("region_features", "crop_size", "min_box_frac", "backbone_size", "backbone_precision",
                "backbone", "proposal_mode", "proposal_resize", "proposals", "detector_floor", "detector_classes",
                "region_ranker", "head_regions", "head_min_box_frac")


def add_region_flags(ap: argparse.ArgumentParser, names: Sequence[str] = REGION_FLAGS) -> None:
    """The image-fragment flags named (default `REGION_FLAGS`: --region-features, --crop-size, --min-box-frac, ...),
    from `ImageConfig`'s fields; each is None unless given (the run's own settings are kept, see
    `with_region_flags`)."""
    fields = {f.name: f for f in dataclasses.fields(ImageConfig)}
    hints = _hints(ImageConfig)
    group = ap.add_argument_group("image fragments (ImageConfig: each overrides the model's or the variant's where "
                                  "given)")
    for name in names:
        f = fields[name]
        add_field_flag(group, name, hints[name], help=f.metadata["help"], choices=f.metadata["choices"],
                       made_from=f"ImageConfig.{name}")


def with_region_flags(cfg: ImageConfig, args: argparse.Namespace) -> ImageConfig:
    """`cfg` with the region flags that were set (see `add_region_flags`)."""
    given = {k: getattr(args, k, None) for k in REGION_FLAGS}
    return dataclasses.replace(cfg, **{k: v for k, v in given.items() if v is not None})
