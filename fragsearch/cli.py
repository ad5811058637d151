"""`fragsearch`: one command line for the service, the indexer, searches from a terminal and the trainer.

    fragsearch serve                          # prepare what is missing, serve on http://127.0.0.1:8000
    fragsearch index ~/Pictures               # index a folder of photos (or sync it again)
    fragsearch search "a dog on a beach"      # the best photos' paths, from the saved index
    fragsearch --config site.toml serve       # every command reads the same settings

Every command of fragsearch/commands/ is a subcommand (`SUBCOMMANDS`: the service's, the indexer's, the
trainer's); the `python -m fragsearch.training.train`-style lines the docs write are aliases of the same
commands. Every subcommand reads its settings from one object (fragsearch/settings.py): flags > FRAGSEARCH_*
environment variables > .env > fragsearch.toml (or --config FILE) > defaults. `fragsearch COMMAND --help` says
what a command reads and writes. The trainer's commands (train, release, evaluate, calibrate, ...) need the
trainer's environment (torch: the `train` extra, `pip install 'fragsearch[train]'`, or ./run, which makes it).

A known failure (a missing package, a missing or stale index, an unreadable photo, a bad setting ...) ends
the command with one line on stderr, what went wrong and what to do, and the exit status of its kind
(`EXIT_STATUSES`, KNOWN: one table, read by one handler around the dispatch, `_Commands.invoke`);
`fragsearch --debug COMMAND` or FRAGSEARCH_DEBUG=1 shows its traceback too. Any other exception is a bug and
shows its traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from fragsearch.service.version import __version__
from fragsearch.settings import config_named, debug_requested, settings_error_line

logger = logging.getLogger("fragsearch")

# a subcommand's own parser reads its arguments and answers its --help
_PASS = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}
_TRAINER_PACKAGES = ("torch", "torchvision", "transformers", "onnx")

# exit statuses: the kind of failure, for a person and for a script (`fragsearch --help` and
# docs/operations/index.md#exit-statuses list them)
NOTHING_FOUND = 1  # search/annotate: no result reaches --min-relevance; data: the check found problems
USAGE = 2  # a bad flag, argument or setting value, or a file or folder named by one that does not exist
MISSING_PACKAGE = 3  # a package this command needs is not installed
NO_INDEX = 4  # the index to read is missing, of another model, damaged, or changed meanwhile
UNREADABLE = 5  # a file or folder is there but cannot be read (not an image, truncated, no permission, disk full)
MODEL = 6  # the model is missing, damaged or cannot be run here
INTERRUPTED = 130  # Ctrl-C
EXIT_STATUSES = {  # the --help text's table (docs/operations/index.md#exit-statuses says more)
    0: "done",
    NOTHING_FOUND: "nothing found (--min-relevance), data check failed; or a bug (traceback)",
    USAGE: "a bad flag, argument or setting, or a path named that does not exist",
    MISSING_PACKAGE: "a package is not installed (MiniLM's files; torch for train ...)",
    NO_INDEX: "no index, or one of another model: fragsearch index DIR (or serve)",
    UNREADABLE: "a file cannot be read: not an image, truncated, no permission",
    MODEL: "the model is missing or damaged, or cannot run here",
    INTERRUPTED: "interrupted (Ctrl-C)",
}


@dataclass(frozen=True)
class Known:
    """A known failure: exceptions of `kinds` ("module:Class"; looked up only in modules imported already,
    so that the table costs no import: an exception of a module never imported cannot have been raised) for
    which `applies` holds end the command with `status` and one line: the exception's message and `hint`."""

    kinds: tuple[str, ...]
    status: int
    hint: str = ""
    applies: Callable[[BaseException], bool] = lambda e: True
    describe: Callable[[BaseException], str] | None = None  # the message, where str(e) is not the one

    def matches(self, e: BaseException) -> bool:
        for kind in self.kinds:
            module, name = kind.split(":")
            cls = getattr(sys.modules.get(module), name, None)
            if isinstance(cls, type) and isinstance(e, cls) and self.applies(e):
                return True
        return False


PROJECT_PACKAGES = ("fragsearch", "bench", "tools")  # the installed namespace, and the checkout's benches and tools


def _absent_package(e: BaseException) -> bool:
    """A ModuleNotFoundError for a package that is not installed, not for a module of the project's own (a
    bug); the project's own raise names none."""
    return (getattr(e, "name", None) or "").split(".")[0] not in PROJECT_PACKAGES


def _says_not_installed(e: BaseException) -> bool:
    """A checkpoint error or an ImportError the project raises for a package that is not installed (a model's
    weight package, a backbone's, the Milvus client), not a bug's `cannot import name`."""
    return isinstance(e.__cause__, ImportError) or "not installed" in str(e) or (
        type(e) is ImportError and "pip install" in str(e))


def _settings_refused(e: BaseException) -> bool:
    """A pydantic ValidationError of the settings (not of a request or a file the service reads)."""
    return getattr(e, "title", None) == "Settings"


_NO_MODEL = ("leave model_path and variant unset to use the released model (model/released/), or train one "
             "with fragsearch train --variant V")
_DAMAGED = ("in a checkout `git checkout -- model/released` restores the released model; a model of your own: "
            "train it again (fragsearch train)")
# the first entry that matches wins: the specific kinds before the general ones they derive from
KNOWN = (
    Known(("fragsearch.settings:SettingsFileError",), USAGE, "fix the file, or name another with --config FILE"),
    Known(("pydantic_core:ValidationError",), USAGE, applies=_settings_refused,
          describe=lambda e: settings_error_line(e) if isinstance(e, Exception) else str(e)),
    Known(("fragsearch.model.device:DeviceError",), USAGE, "set device to auto or cpu (--device, FRAGSEARCH_DEVICE)"),
    Known(("fragsearch.model.variants:VariantError",), USAGE, "fragsearch train --help lists the variants"),
    Known(("fragsearch.model.data:DataError",), USAGE,
          "fragsearch data SRC DEST puts a Flickr8K download in the project's "
          "layout; --data or FRAGSEARCH_DATA names the folder"),
    Known(("fragsearch.model.fragments:NoFragmentsError",), USAGE,
          "say what is in the picture with words the model knows"),
    Known(("builtins:ModuleNotFoundError",), MISSING_PACKAGE, applies=_absent_package),  # hint: _package_hint
    Known(("fragsearch.service.prepare:BackendMissing", "fragsearch.model.detector:DetectorMissing"), MISSING_PACKAGE),
    Known(("fragsearch.model.modelfile:CheckpointError", "builtins:ImportError"), MISSING_PACKAGE,
          "install the locked packages: pip install -r requirements.lock (./run does it in a checkout)",
          _says_not_installed),
    Known(("fragsearch.index.types:IndexLoadError", "fragsearch.index.shards:ShardError"), NO_INDEX,
          "make it with fragsearch index DIR (a folder of photos) or fragsearch serve; an index of another model "
          "is set aside and made anew"),
    Known(("fragsearch.index.catalogue:StaleWriterError",), NO_INDEX,
          "another process changed the index: run the command "
          "again"),
    Known(("fragsearch.model.modelfile:CheckpointError",), USAGE, _NO_MODEL,  # model_path or variant names no model
          lambda e: str(e).startswith("model not found")),
    Known(("fragsearch.service.prepare:ModelMissing", "fragsearch.model.graphs:GraphMissing",
           "fragsearch.model.minilm:GraphMismatch"), MODEL),
    Known(("fragsearch.model.modelfile:CheckpointError", "fragsearch.model.release:ReleaseError"), MODEL, _DAMAGED),
    Known(("fragsearch.model.imageio:ImageReadError",), UNREADABLE,
          "give a photo Pillow reads (JPEG, PNG, HEIC, WebP ...), "
          "not a damaged or partial copy"),
    Known(("fragsearch.index.types:IndexFullError",), UNREADABLE, "free some disk space, then run the command again"),
    Known(("builtins:PermissionError", "builtins:IsADirectoryError"), UNREADABLE,
          "check the path and its permissions"),
    Known(("builtins:FileNotFoundError", "builtins:NotADirectoryError"), USAGE, "check the path (an argument, "
          "a flag or a setting)"),
)


# a message that names one of these says what to do already: no hint is added to it
_FIXES = ("`fragsearch", "fragsearch index", "fragsearch serve", "fragsearch train", "pip install", "./run ",
          "git checkout")


def _package_hint(e: ModuleNotFoundError, command: str) -> str:
    if (e.name or "").split(".")[0] in _TRAINER_PACKAGES:
        return (f"fragsearch {command} needs the trainer's environment (torch): pip install 'fragsearch[train]', "
                f"or ./run {command} in a checkout")
    return "install the locked packages: pip install -r requirements.lock (./run does it in a checkout)"


def _message(e: BaseException, known: Known) -> str:
    """The exception's message on one line (a file error: its path and why)."""
    if known.describe is not None:
        text = known.describe(e)
    elif isinstance(e, OSError) and e.filename is not None and e.strerror and type(e).__str__ is OSError.__str__:
        text = f"cannot read {e.filename}: {e.strerror}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def known_failure(e: BaseException, command: str) -> tuple[int, str] | None:
    """(exit status, the one line) of a known failure; None for anything else (a bug: its traceback)."""
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED, "interrupted"
    for known in KNOWN:
        if known.matches(e):
            hint = _package_hint(e, command) if isinstance(e, ModuleNotFoundError) else known.hint
            message = _message(e, known)
            if hint and not any(fix in message for fix in _FIXES):
                message += f" ({hint})"
            return known.status, message
    return None


class _Commands(click.Group):
    """The group whose one handler answers a subcommand's known failure (KNOWN) with one line and its exit
    status; --debug (or FRAGSEARCH_DEBUG=1) prints the traceback above it. Other exceptions propagate."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (Exception, KeyboardInterrupt) as e:
            if isinstance(e, click.exceptions.ClickException | click.exceptions.Exit | click.exceptions.Abort):
                raise
            command = ctx.invoked_subcommand or ""
            failure = known_failure(e, command)
            if failure is None:
                raise
            status, line = failure
            if ctx.params.get("debug") or debug_requested():
                traceback.print_exc()
            with contextlib.suppress(OSError):  # what was printed comes before the line
                sys.stdout.flush()
            sys.stderr.write(f"fragsearch{' ' + command if command else ''}: error: {line}\n")
            sys.exit(status)


def _run(main: Callable[..., Any], args: Sequence[str], prog: str) -> None:
    """Call a subcommand's main with its arguments; its status (None: 0) is the process's (a known failure it
    raises: `_Commands.invoke`)."""
    sys.exit(main(list(args), prog=prog) or 0)


@dataclass(frozen=True)
class Subcommand:
    """A `fragsearch` subcommand: its name, its main ("module:function" in fragsearch/commands/, imported when
    it runs: a trainer's command needs torch, which KNOWN names where it is missing), and what it does, reads
    and writes (`fragsearch --help`; `fragsearch NAME --help` is its parser's)."""

    name: str
    main: str
    summary: str

    def load(self) -> Callable[..., Any]:
        import importlib

        module, function = self.main.split(":")
        main: Callable[..., Any] = getattr(importlib.import_module(f"fragsearch.commands.{module}"), function)
        return main


_TRAINER = "(the trainer's environment)"
SUBCOMMANDS = (
    Subcommand("serve", "serve:main", "Serve the page and the API (prepares missing indexes first). Reads every "
               "setting; writes the artifacts folder (indexes, caches, uploads)."),
    Subcommand("prepare", "prepare:main", "Prepare what serving needs (the model, the indexes) and exit, without "
               "serving. Reads every setting; writes the artifacts folder."),
    Subcommand("index", "index_sync:main", "Index a folder of photos, or sync its index again (new, changed, "
               "renamed, deleted files). Reads the folder; writes its index in the artifacts folder and the "
               "feature cache."),
    Subcommand("search", "terminal:search_main", "Search the saved image index for a sentence, without a server: "
               "paths (-f), or JSON with the alignments (--json). Reads the index and the model; writes nothing."),
    Subcommand("annotate", "terminal:annotate_main", "The collection's sentences for a photo, from the saved "
               "sentence index, without a server. Reads the photo, the index and the model; writes nothing."),
    Subcommand("duplicates", "duplicates:main", "Groups of near-duplicate photos in an image index. Reads the "
               "index; writes a JSON report if asked."),
    Subcommand("data", "data:main", "Put a Flickr8K download into the project's layout and check it. Reads the "
               "download; writes the data folder."),
    Subcommand("build", "index_build:main", "Build or extend an image index from a folder of images and a "
               "sentence index from captions, with a model of your choice. Reads the images, the captions and "
               "the model; writes the indexes and the feature cache."),
    Subcommand("bulk", "index_bulk:main", "Extract many images into fragment shards on worker processes or a Ray "
               "cluster, then load them into an index. Reads the images; writes the shards and the index."),
    Subcommand("train", "train:main", f"Train a model of your own {_TRAINER}. Reads the data folder and the "
               "feature cache; writes <artifacts>/models/<variant>/."),
    Subcommand("release", "release:main", f"Make a trained model the released one {_TRAINER}. Reads the model; "
               "writes model/released/ with its manifest."),
    Subcommand("evaluate", "evaluate:main", f"Recall@K of a model on a split {_TRAINER}. Reads the model, the "
               "data folder and the feature cache; writes a JSON report if asked."),
    Subcommand("calibrate", "calibrate:main", f"Fit a model's score calibration and relevance scale {_TRAINER}. "
               "Reads the model and the data folder; writes the model."),
    Subcommand("extract", "extract:main", "Extract the image fragments of a data folder's splits into the feature "
               "cache (resumable). Reads the images; writes the feature cache."),
    Subcommand("cutpoint", "cutpoint:main", f"Store the region crops' activations at a cut point of the backbone, "
               f"for fine-tuning {_TRAINER}. Reads the images; writes the store."),
    Subcommand("finetune", "finetune:main", f"Fine-tune the backbone's top with the fragment objective "
               f"{_TRAINER}. Reads a trained model and the cut-point store; writes a model and its backbone."),
    Subcommand("merge", "merge:main", f"Merge trained models into one, their blocks side by side {_TRAINER}. "
               "Reads the members; writes the merged model."),
    Subcommand("evidence", "evidence:main", "Refit a model's phrase evidence beside it. Reads the model and the "
               "data folder; writes the model with its evidence."),
    Subcommand("grounder", "grounder:main", f"Train a model's grounder on Flickr30k Entities boxes {_TRAINER}. "
               "Reads the model, the data folder and the Entities; writes the model with its grounder."),
    Subcommand("presence", "presence:main", f"Train a model's presence head and phrase evidence {_TRAINER}. "
               "Reads the model and the data folder; writes the model with them."),
    Subcommand("regions", "regions:main", f"Train a region ranker on Flickr30k Entities boxes {_TRAINER}. Reads "
               "the model, the data folder and the Entities; writes the ranker into the graph folder and the model."),
    Subcommand("export-backbone", "graphs:backbone_main", f"Make the backbone's graph and ImageNet head arrays the "
               f"runtime reads {_TRAINER}. Writes the graph folder."),
    Subcommand("export-minilm", "graphs:minilm_main", f"Make MiniLM's graph the runtime reads {_TRAINER}. Writes "
               "the graph folder."),
)


# the exit statuses in the help text, above the options and commands (`fragsearch --help`)
_HELP = ("Finds images for a sentence and sentences for an image, and shows which phrase matched which region."
         "\n\nA known failure prints one line on stderr, what went wrong and what to do, and exits with its "
         "status (--debug or FRAGSEARCH_DEBUG=1: its traceback too):\n\n\b\n"
         + "\n".join(f"{status:>3}  {text}" for status, text in EXIT_STATUSES.items()))


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]}, help=_HELP)
@click.version_option(__version__, prog_name="fragsearch")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="the TOML settings file every subcommand reads (default: FRAGSEARCH_CONFIG, else "
                   "./fragsearch.toml where it exists)")
@click.option("--debug", is_flag=True, default=False,
              help="show the traceback of a known failure too (or FRAGSEARCH_DEBUG=1)")
@click.pass_context
def cli(ctx: click.Context, config: Path | None, debug: bool) -> None:
    """Finds images for a sentence and sentences for an image, and shows which phrase matched which region."""
    ctx.with_resource(config_named(config))
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars on a terminal; logged lines elsewhere


def _add(sub: Subcommand) -> None:
    """`fragsearch NAME ARGS...`: the subcommand's own parser reads ARGS (and answers its --help)."""

    def run(args: tuple[str, ...]) -> None:
        _run(sub.load(), args, f"fragsearch {sub.name}")

    command = click.argument("args", nargs=-1, type=click.UNPROCESSED)(run)
    cli.command(name=sub.name, help=sub.summary, context_settings=_PASS, add_help_option=False)(command)


for _sub in SUBCOMMANDS:
    _add(_sub)


def main(argv: Sequence[str] | None = None) -> None:
    """The console script (pyproject.toml [project.scripts])."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="fragsearch")
