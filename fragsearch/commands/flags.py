"""Command-line flags of the index settings, made from the fields of `IndexShape` and `SearchSettings`
(their defaults, types, choices and help): one `--name` a field (`--k-prime`, `--store-dtype`, ...),
read back as `IndexSettings`. A flag set with a prefix (`--sentence-k-prime`) sets the same field of a
second index's settings."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable

from fragsearch.index.types import SAVED_ORDER, IndexSettings, IndexShape, SearchSettings


def _fields() -> dict[str, dataclasses.Field[object]]:
    both = {f.name: f for f in (*dataclasses.fields(IndexShape), *dataclasses.fields(SearchSettings))}
    return {name: both[name] for name in SAVED_ORDER}


def _dest(prefix: str, name: str) -> str:
    return f"index_{prefix.replace('-', '_')}{name}"


def add_index_flags(ap: argparse.ArgumentParser, defaults: IndexSettings, names: Iterable[str] | None = None,
                    prefix: str = "", what: str = "") -> None:
    """One flag per field named (default: every field of both types) with `defaults`' values; `prefix`
    ("sentence-") and `what` ("sentence index: ") for a second index's flags."""
    fields = _fields()
    values = defaults.to_dict()
    group = ap.add_argument_group(f"{what.rstrip(': ') or 'index'} settings (IndexShape: saved with the index, "
                                  "a rebuild to change; SearchSettings: per search)")
    for name in fields if names is None else names:
        f = fields[name]
        default = values[name]
        flag = f"--{prefix}{name.replace('_', '-')}"
        text = f"{what}{f.metadata['help']}"
        if isinstance(default, bool):
            group.add_argument(flag, dest=_dest(prefix, name), action=argparse.BooleanOptionalAction,
                               default=default, help=text)
        else:
            group.add_argument(flag, dest=_dest(prefix, name), type=type(default), default=default,
                               choices=f.metadata["choices"], metavar=None if f.metadata["choices"] else name.upper(),
                               help=f"{text} (default {default!r})")


def index_settings_of(args: argparse.Namespace, base: IndexSettings, prefix: str = "") -> IndexSettings:
    """`base` with every field whose flag `add_index_flags` added (with `prefix`) set from `args`."""
    values = base.to_dict()
    for name in values:
        dest = _dest(prefix, name)
        if hasattr(args, dest):
            values[name] = getattr(args, dest)
    return IndexSettings.of(**values)
