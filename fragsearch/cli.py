"""`fragsearch`: one command line for the service, the indexer, searches from a terminal and the trainer.

    fragsearch serve                          # prepare what is missing, serve on http://127.0.0.1:8000
    fragsearch index ~/Pictures               # index a folder of photos (or sync it again)
    fragsearch search "a dog on a beach"      # the best photos' paths, from the saved index
    fragsearch --config site.toml serve       # every command reads the same settings

Every subcommand reads its settings from one object (model/settings.py): flags > FRAGSEARCH_* environment
variables > .env > fragsearch.toml (or --config FILE) > defaults. `fragsearch COMMAND --help` says what a
command reads and writes. train, release and evaluate need the trainer's environment (torch: the `train`
extra, `pip install 'fragsearch[train]'`, or ./run, which makes it).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from model.settings import SettingsFileError, config_named
from service.version import __version__

logger = logging.getLogger("fragsearch")

# a subcommand's own parser reads its arguments and answers its --help
_PASS = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}
_TRAINER = "needs the trainer's environment (torch): pip install 'fragsearch[train]', or ./run {} in a checkout"


def _run(main: Callable[..., Any], args: Sequence[str], prog: str) -> None:
    """Call a subcommand's main with its arguments; its status (None: 0) is the process's."""
    try:
        status = main(list(args), prog=prog)
    except SettingsFileError as e:
        raise click.UsageError(str(e)) from e
    sys.exit(status or 0)


def _trainer(name: str) -> Callable[..., Any]:
    """The main of a training command, or a usage error saying what to install where torch is absent."""
    import importlib

    try:
        return importlib.import_module(f"training.{name}").main  # type: ignore[no-any-return]
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] in ("torch", "torchvision", "transformers", "onnx"):
            raise click.ClickException(f"fragsearch {name} {_TRAINER.format(name)}") from e
        raise


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fragsearch")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="the TOML settings file every subcommand reads (default: FRAGSEARCH_CONFIG, else "
                   "./fragsearch.toml where it exists)")
@click.pass_context
def cli(ctx: click.Context, config: Path | None) -> None:
    """Finds images for a sentence and sentences for an image, and shows which phrase matched which region."""
    ctx.with_resource(config_named(config))
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars on a terminal; logged lines elsewhere


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve(args: tuple[str, ...]) -> None:
    """Serve the page and the API (prepares missing indexes first). Reads every setting; writes the
    artifacts folder (indexes, caches, uploads)."""
    from service.__main__ import main

    _run(main, args, "fragsearch serve")


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def index(args: tuple[str, ...]) -> None:
    """Index a folder of photos, or sync its index again (new, changed, renamed, deleted files). Reads the
    folder; writes its index in the artifacts folder and the feature cache."""
    from index.sync import main

    _run(main, args, "fragsearch index")


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def search(args: tuple[str, ...]) -> None:
    """Search the saved image index for a sentence, without a server: paths (-f), or JSON with the
    alignments (--json). Reads the index and the model; writes nothing."""
    from service.terminal import search_main

    _run(search_main, args, "fragsearch search")


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def annotate(args: tuple[str, ...]) -> None:
    """The collection's sentences for a photo, from the saved sentence index, without a server. Reads the
    photo, the index and the model; writes nothing."""
    from service.terminal import annotate_main

    _run(annotate_main, args, "fragsearch annotate")


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def duplicates(args: tuple[str, ...]) -> None:
    """Groups of near-duplicate photos in an image index. Reads the index; writes a JSON report if asked."""
    from index.duplicates import main

    _run(main, args, "fragsearch duplicates")


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def data(args: tuple[str, ...]) -> None:
    """Put a Flickr8K download into the project's layout and check it. Reads the download; writes the
    data folder."""
    from model.flickr8k import main

    _run(main, args, "fragsearch data")


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train(args: tuple[str, ...]) -> None:
    """Train a model of your own (the trainer's environment). Reads the data folder and the feature cache;
    writes <artifacts>/models/<variant>/."""
    _run(_trainer("train"), args, "fragsearch train")


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def release(args: tuple[str, ...]) -> None:
    """Make a trained model the released one (the trainer's environment). Reads the model; writes
    model/released/ with its manifest."""
    _run(_trainer("release"), args, "fragsearch release")


@cli.command(context_settings=_PASS, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def evaluate(args: tuple[str, ...]) -> None:
    """Recall@K of a model on a split (the trainer's environment). Reads the model, the data folder and the
    feature cache; writes a JSON report if asked."""
    _run(_trainer("evaluate"), args, "fragsearch evaluate")


def main(argv: Sequence[str] | None = None) -> None:
    """The console script (pyproject.toml [project.scripts])."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="fragsearch")
