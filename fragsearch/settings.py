"""The one settings object of every command: flags, FRAGSEARCH_* environment variables, `.env` and
`fragsearch.toml`, in that order of precedence, over the defaults.

    fragsearch serve --port 8080 --heavy-slots 1    # a flag for every setting (fragsearch serve --help)
    FRAGSEARCH_PORT=8080 fragsearch serve           # or an environment variable, or a line of .env
    fragsearch --config site.toml index ~/Pictures  # or a TOML file: port = 8080 (default ./fragsearch.toml,
                                                    # FRAGSEARCH_CONFIG names another)

`Settings` holds every setting of every command (the service's, and the paths, model, collection and
index shape that indexing, search and training read too). A command reads them once, at the door (its flags
over the rest: fragsearch/commands/flags.py `settings_of`), and passes down what the code below needs as
arguments; nothing below the commands reads them. `from_environment()` and the `default_*()` helpers are the
settings of a process with no command line of its own (benchmarks, tools, tests). This is the only module that
reads a FRAGSEARCH_* variable (tests/test_settings.py).

Paths left unset are derived from the artifacts folder (git-ignored in a checkout; outside one, the user's
data directory), so that the embedded default needs no configuration at all. A key of the TOML file that
names no setting is an error.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticUseDefault
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from fragsearch.index.types import BackendOptions
from fragsearch.model.config import collection_index
from fragsearch.model.device import check_device_name
from fragsearch.model.imageio import DEFAULT_MAX_PIXELS
from fragsearch.model.places import DEFAULT_ARTIFACTS, DEFAULT_DATA, Places
from fragsearch.model.release import served_model_path
from fragsearch.model.resources import default_workers

DEFAULT_K = 10  # images or regions a search returns when it names no k (settings.k_max may not be smaller)
API_KEY_HEADER = "X-API-Key"
CONFIG_FILE = "fragsearch.toml"  # read from the working folder unless FRAGSEARCH_CONFIG or --config names another
_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("fragsearch_config", default=None)


class SettingsFileError(ValueError):
    """The settings file names a setting that does not exist, or cannot be read."""


def config_file() -> Path:
    """The TOML settings file in force: --config, else FRAGSEARCH_CONFIG, else ./fragsearch.toml."""
    return _config_file.get() or Path(os.environ.get("FRAGSEARCH_CONFIG") or CONFIG_FILE)


class CheckedTomlSource(TomlConfigSettingsSource):
    """fragsearch.toml: top-level keys named like the settings; a key that names none is an error (a typo
    would otherwise be ignored), and so is a file FRAGSEARCH_CONFIG or --config names that is missing."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        path = config_file()
        named = _config_file.get() is not None or bool(os.environ.get("FRAGSEARCH_CONFIG"))
        if named and not path.is_file():
            raise SettingsFileError(f"settings file {path} not found")
        try:
            super().__init__(settings_cls, toml_file=path)
        except ValueError as e:  # tomllib.TOMLDecodeError
            raise SettingsFileError(f"{path}: not valid TOML ({e})") from e
        unknown = sorted(set(self.toml_data) - set(settings_cls.model_fields))
        if unknown:
            verb = "is not a setting" if len(unknown) == 1 else "are not settings"
            raise SettingsFileError(f"{path}: {', '.join(unknown)} {verb} (fragsearch serve --help lists them)")



class Settings(BaseSettings):
    """Everything the service reads at start-up (environment variable = FRAGSEARCH_ + upper-case name)."""

    model_config = SettingsConfigDict(env_prefix="FRAGSEARCH_", env_file=".env", extra="ignore")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments (and flags: `from_args`) before the environment, .env and then fragsearch.toml."""
        return init_settings, env_settings, dotenv_settings, CheckedTomlSource(settings_cls), file_secret_settings

    # where things are
    data: Path = Field(default=DEFAULT_DATA, description="data folder (images/, captions.txt, splits); "
                       "default ../shared/data/flickr8k beside a checkout, <user data directory>/flickr8k elsewhere")
    data_mounted_from: str | None = Field(
        default=None, description="the host folder mounted as the data folder (docker-compose.yml sets it from "
        "FRAGSEARCH_DATA_HOST; empty when it mounted none), named when the data folder is unusable")
    artifacts: Path = Field(default=DEFAULT_ARTIFACTS, description="weights, caches and indexes; "
                            "default artifacts/ in a checkout (git-ignored), the user's data directory elsewhere "
                            "(~/.local/share/fragsearch on Linux)")

    # what the embedded default prepares when it is missing
    prepare: bool = Field(default=True,
                          description="python -m fragsearch.service: train / build what is missing before serving")
    variant: str | None = Field(default=None, description="a model variant (model/variants/<name>.toml): the one "
                                "train trains (default full) and extract and cutpoint take the image settings of; "
                                "served instead of the released model (model/released/) from its checkpoint "
                                "<artifacts>/models/<variant>/model.pt, trained on the first start when missing")
    image_split: str = Field(default="dev", description="split whose images are indexed")
    collection: Path | None = Field(default=None, description="a folder of your own photos to serve instead of the "
                                    "image split: indexed on the first start and synced (new, changed, renamed, "
                                    "deleted files) at every start (index/sync.py); empty: none")
    exclude: list[str] = Field(default_factory=list, description="gitignore-style patterns of the collection's "
                               "files and folders to leave out (also read from its .fragsearchignore), e.g. "
                               "[\"Screenshots/\", \"*.png\"]")
    watch: bool = Field(default=True, description="with a collection: follow the folder while serving (added, "
                        "changed, moved, deleted photos reach the index without a restart; service/watch.py)")
    watch_debounce_ms: int = Field(default=1000, ge=50, le=60_000, description="how long the folder must be quiet "
                                   "after a change before the changes are applied (ms)")
    watch_rescan: float = Field(default=300.0, gt=0, description="seconds between two syncs of the watched folder "
                                "when no change was noticed (the fallback for changes a watcher cannot see)")
    watch_polling: bool = Field(default=False, description="poll the folder instead of waiting for file-system "
                                "events (network mounts without inotify)")
    sentence_split: str = Field(default="train", description="split whose captions form the sentence collection")
    captions: Path | None = Field(default=None, description="a text file of sentences, one a line (or lines "
                                  "`<image>#<n><TAB><caption>` as in captions.txt), to form the sentence collection "
                                  "that /annotate ranks instead of the data folder's sentence_split captions; "
                                  "without it and without a data folder, /annotate answers 409")

    # where the parts are: each path has one name, derived from the settings above when left unset
    model_path: Path = Field(default_factory=lambda v: served_model_path(v["artifacts"], v["variant"]),
                             description="the model served (a runtime-form folder or its model.json; a trainer's "
                             "model.pt where torch is installed); default: the released model "
                             "(model/released/model.json, checked against its manifest), or "
                             "<artifacts>/models/<variant>/model.pt when a variant is named")
    image_index: Path = Field(
        default_factory=lambda v: (collection_index(v["artifacts"], v["collection"]) if v["collection"] is not None
                                   else v["artifacts"] / "index" / f"images-{v['image_split']}"),
        description="image index folder; default <artifacts>/index/images-<split>")
    sentence_index: Path = Field(
        default_factory=lambda v: v["artifacts"] / "index" / f"sentences-{v['sentence_split']}",
        description="sentence index folder; default <artifacts>/index/sentences-<split>")
    uploads: Path = Field(default_factory=lambda v: v["artifacts"] / "uploads",
                          description="where POST /images stores files; default <artifacts>/uploads")
    cache: Path = Field(default_factory=lambda v: v["artifacts"] / "cache",
                        description="feature/parse cache; default <artifacts>/cache")
    index_kind: str = Field(default="flat", description="index kind of newly built indexes (flat, hnsw, ivf, "
                            "ivfpq: FAISS kinds, mapped onto Milvus index types with the milvus backend)")
    index_backend: Literal["faiss", "milvus"] = Field(
        default="faiss", description="where candidate vectors are searched: faiss (in-process, the embedded "
        "default) or milvus (a Milvus server or cluster at milvus_uri, or milvus-lite)")
    milvus_uri: str | None = Field(
        default=None, description="Milvus server or cluster (http://host:19530), or a milvus-lite folder "
        "(path/file.db); default: milvus.db inside each index folder")
    milvus_token: SecretStr | None = Field(default=None, description="Milvus credentials (user:password or key)")
    candidates_mapped: bool = Field(
        default=True, description="faiss: a loaded index keeps its stored vectors in its file, mapped read-only, "
        "until it is written to, and a recall's scan (an annotation's) lets each chunk's pages go after it: the "
        "process holds none of them between requests (the kernel's cache keeps them), each scan maps them again "
        "(for 30,000 captions on 2 cores: 490 MB less held, ~50 ms more per annotation); false: read into memory")
    workers: int | None = Field(default=None, ge=1, description="feature extraction processes (preparing, indexing, "
                                "training, extracting, evaluating); "
                                "default: one per CPU this process may use, as many as fit in its memory "
                                "(model/resources.py)")
    limit: int | None = Field(default=None, ge=1, description="only the first N images of each split, a small trial: "
                              "what the preparation trains on, indexes and takes captions from; what extract and "
                              "evaluate read")
    progress_every: float = Field(default=30.0, gt=0, description="seconds between progress lines of "
                                  "python -m fragsearch.service.prepare")

    # serving
    host: str = Field(default="127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    device: str = Field(default="auto", description="auto (cuda when available), cpu or cuda: model, "
                        "MiniLM, image backbone, training and FAISS (model/device.py)")
    threads: int | None = Field(default=None, ge=1, description="intra-op threads of the model's graphs (ONNX Runtime) "
                                "and OpenCV; default: the CPUs the process may use")
    numeric_threads: int | None = Field(default=None, ge=1, description="threads of NumPy's products (BLAS) and "
                                        "FAISS (OpenMP) in the server; default: the CPUs shared out among the "
                                        "search_slots (at least one each): requests run side by side, each on its "
                                        "share, not each on every core")
    warmup: bool = Field(default=True, description="run one search and one annotation before reporting ready")
    heavy_slots: int = Field(default=2, ge=1, description="image extractions (annotate, uploads) run at once; "
                             "more requests wait their turn")
    heavy_queue: int = Field(default=4, ge=0, description="annotate / upload requests that may wait for a slot; "
                             "more are refused at once with 503 and Retry-After")
    heavy_deadline: float = Field(default=30.0, gt=0, description="seconds an annotate / upload request may take "
                                  "(waiting included) before it is answered 504")
    search_slots: int = Field(default=4, ge=1, description="searches (images, fragments) running at once")
    search_queue: int = Field(default=16, ge=0, description="searches that may wait for a slot; more get 503")
    search_deadline: float = Field(default=10.0, gt=0, description="seconds a search may take before it is "
                                   "answered 504")
    retry_after: float = Field(default=1.0, gt=0, description="seconds a refused client is told to wait (Retry-After)")
    body_timeout: float = Field(default=15.0, gt=0, description="seconds allowed between two parts of a request "
                                "body (a body shorter than its Content-Length gets 408)")
    freeze_heap: bool = Field(default=True, description="once loaded, move the model's and indexes' objects out of "
                              "the garbage collector's reach (gc.freeze): a full collection over them pauses every "
                              "request for ~0.4 s")
    log_level: str = Field(default="info", description="lowest level logged: debug, info, warning, error")
    log_format: Literal["text", "json"] = Field(default="text", description="log lines as text or as one JSON "
                                                "object each (time, level, logger, message, exception)")
    cors_origins: list[str] = Field(default_factory=list, description="origins allowed to call the API from a "
                                    "browser (CORS), e.g. [\"https://photos.example.org\"]; empty: none (the default)")

    # writes
    api_key: SecretStr | None = Field(
        default=None, description=f"key required in the {API_KEY_HEADER} header for writes")
    auth_disabled: bool = Field(default=False, description="accept writes without a key (explicit opt-out only)")

    # limits
    max_sentence_chars: int = Field(default=300, ge=1, description="longest sentence or phrase accepted")
    k_max: int = Field(default=100, ge=1, description="largest k accepted")
    max_rank: int = Field(default=1000, ge=1, description="deepest rank a page may reach (offset + k)")
    max_upload_bytes: int = Field(default=10 * 1024 * 1024, ge=1, description="largest upload request body "
                                  "(the image file and its multipart framing)")
    max_pixels: int = Field(default=DEFAULT_MAX_PIXELS, ge=1, description="largest image (width x height) "
                            "decoded for uploads, thumbnails and renditions; the default is the indexer's own limit, "
                            "so every indexed photo gets its thumbnail")
    max_json_bytes: int = Field(default=64 * 1024, ge=1024, description="largest JSON request body")

    @field_validator("limit", "workers", "variant", "collection", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value  # FRAGSEARCH_LIMIT= (compose)

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        return check_device_name(value)  # whether this machine has it is checked at start-up

    @field_validator("model_path", "image_index", "sentence_index", "uploads", "cache", mode="before")
    @classmethod
    def _none_is_derived(cls, value: object) -> object:
        if value is None:  # as if left unset: the default made from the settings above
            raise PydanticUseDefault
        return value

    @field_validator("collection")
    @classmethod
    def _resolved(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser().resolve()

    @model_validator(mode="after")
    def _checked(self) -> Settings:
        if self.api_key is not None and not self.api_key.get_secret_value().strip():
            self.api_key = None  # an empty FRAGSEARCH_API_KEY means no key
        if self.k_max < DEFAULT_K:
            raise ValueError(f"k_max ({self.k_max}) must be at least {DEFAULT_K}, the k of a search that names none")
        return self

    def data_hint(self) -> str:
        """What to change when the data folder is missing or unusable: FRAGSEARCH_DATA_HOST (or
        FRAGSEARCH_COLLECTION_HOST) on the host when compose started the service (it sets data_mounted_from,
        empty when it mounted none), else FRAGSEARCH_DATA."""
        make = "./run data SRC DEST makes one from the Flickr8K download and checks it"
        if self.data_mounted_from == "":  # compose, with neither FRAGSEARCH_DATA_HOST nor a collection set
            return ("compose mounted no data folder (FRAGSEARCH_DATA_HOST is not set) and no photos "
                    "(FRAGSEARCH_COLLECTION_HOST is not set): set FRAGSEARCH_COLLECTION_HOST to a folder of your "
                    "photos, or FRAGSEARCH_DATA_HOST to a Flickr8K folder in the project's layout (images/, "
                    f"captions.txt, train.txt, dev.txt); {make}")
        if self.data_mounted_from:
            return (f"{self.data} is the host folder {self.data_mounted_from} that compose mounts: set "
                    f"FRAGSEARCH_DATA_HOST to a Flickr8K folder in the project's layout (images/, captions.txt, "
                    f"train.txt, dev.txt) readable by uid {os.getuid()}; {make}")
        return f"set FRAGSEARCH_DATA to a Flickr8K folder in the project's layout; {make}"

    @property
    def worker_count(self) -> int:
        """Extraction processes: the setting, else one per usable CPU that fits in memory."""
        return self.workers if self.workers is not None else default_workers()

    @property
    def mode(self) -> Literal["collection", "split"]:
        """What is served and indexed: "collection", a folder of one's own photos (the `collection` setting,
        synced at every start and followed while serving), or "split", the data folder's image split
        (`image_split`)."""
        return "collection" if self.collection is not None else "split"

    @property
    def has_sentences(self) -> bool:
        """Whether a sentence collection is configured: a caption file, or the data folder's captions (a
        collection of one's own photos is served without a data folder; /annotate then has nothing to rank)."""
        return self.captions is not None or self.mode == "split" or (self.data / "captions.txt").is_file()

    @property
    def collection_root(self) -> Path:
        """What relative image paths of the image index are read against."""
        return self.collection if self.collection is not None else self.data

    @property
    def thumbnails_dir(self) -> Path:
        return self.cache / "thumbnails"

    @property
    def places(self) -> Places:
        """Where the runtime finds and makes its files (model/places.py): these settings' artifacts and cache."""
        return Places(self.artifacts, self.cache)

    @property
    def backend(self) -> BackendOptions:
        """Where the indexes keep their candidate vectors."""
        token = self.milvus_token.get_secret_value() if self.milvus_token is not None else None
        return BackendOptions(self.index_backend, self.milvus_uri or None, token or None, self.candidates_mapped)

    @property
    def writes_open(self) -> bool:
        """Writes are possible: a key is configured, or auth was switched off explicitly."""
        return self.auth_disabled or self.api_key is not None


# the settings by concern: the sections of docs/operations/settings.md and of a command's --help (each setting in
# exactly one, tests/test_settings.py)
CONCERNS: dict[str, tuple[str, ...]] = {
    "paths": ("data", "data_mounted_from", "artifacts", "cache", "uploads"),
    "model": ("variant", "model_path", "device", "threads", "numeric_threads", "workers"),
    "collection": ("prepare", "image_split", "collection", "exclude", "watch", "watch_debounce_ms", "watch_rescan",
                   "watch_polling", "sentence_split", "captions", "limit", "progress_every"),
    "index": ("image_index", "sentence_index", "index_kind", "index_backend", "milvus_uri", "milvus_token",
              "candidates_mapped"),
    "serving": ("host", "port", "warmup", "freeze_heap", "log_level", "log_format", "cors_origins", "api_key",
                "auth_disabled"),
    "limits": ("heavy_slots", "heavy_queue", "heavy_deadline", "search_slots", "search_queue", "search_deadline",
               "retry_after", "body_timeout", "max_sentence_chars", "k_max", "max_rank", "max_upload_bytes",
               "max_pixels", "max_json_bytes"),
}
CONCERN_TEXT = {
    "paths": "where the data, the artifacts, the caches and the uploads are",
    "model": "the model served or trained and what runs it",
    "collection": "what is indexed and searched: the data set's splits, a folder of photos, captions",
    "index": "the indexes' folders, kind and backend",
    "serving": "the HTTP service: address, logs, access",
    "limits": "what the service admits: requests at once, deadlines, sizes",
}


def concern_of(name: str) -> str:
    """The concern a setting belongs to (`CONCERNS`)."""
    return next(concern for concern, names in CONCERNS.items() if name in names)


def from_environment() -> Settings:
    """The settings of a process that parsed no command line (a benchmark, a tool, a test): the environment,
    `.env` and the settings file over the defaults. A command reads its own once, from its flags too
    (fragsearch/commands/flags.py `settings_of`), and passes them down."""
    return Settings()


@contextlib.contextmanager
def config_named(path: Path | None) -> Iterator[None]:
    """Read the settings file `path` while the block runs (None: the one in force, e.g. named by `fragsearch
    --config`, else FRAGSEARCH_CONFIG, else ./fragsearch.toml)."""
    if path is None:
        yield
        return
    token = _config_file.set(path)
    try:
        yield
    finally:
        _config_file.reset(token)


def default_data_dir() -> Path:
    """The data folder in force (the `data` setting: FRAGSEARCH_DATA, .env, fragsearch.toml, else
    ../shared/data/flickr8k beside a checkout)."""
    return from_environment().data


def default_artifacts_dir() -> Path:
    """Where weights, caches and indexes live (the `artifacts` setting; default artifacts/ in a checkout,
    the user's data directory elsewhere)."""
    return from_environment().artifacts


def default_cache_dir() -> Path:
    """The feature/parse cache in force (the `cache` setting; default <artifacts>/cache)."""
    return from_environment().cache


def default_places(cache: Path | None = None) -> Places:
    """Where the runtime of a command finds and makes its files (model/places.py): the settings in force, with the
    command's `--cache` in place of the `cache` setting when it has one."""
    settings = from_environment()
    return Places(settings.artifacts, settings.cache if cache is None else Path(cache))


def default_model_path() -> Path:
    """The model served (the `model_path` setting, else the named `variant`'s checkpoint, else the released
    model): the default `--model` of the offline commands (index.build, training.evaluate, ...)."""
    return from_environment().model_path


SECRET_SETTINGS = ("api_key", "milvus_token")  # their values are never repeated in a message
DEBUG_VARIABLE = "FRAGSEARCH_DEBUG"  # set (1, true, yes): a command's known failure shows its traceback too


def settings_error_line(e: Exception, flags: Sequence[str] = ()) -> str:
    """One line for a settings file or value the settings refuse: each bad setting's name, the value given
    and why, and where it can be set (its flag where `flags`, a command's options, has it; its variable, .env,
    the settings file)."""
    if not isinstance(e, ValidationError):
        return " ".join(str(e).split())
    parts = []
    for err in e.errors():
        name = ".".join(str(p) for p in err["loc"])
        why = str(err["msg"]).removeprefix("Value error, ")
        if not name or name not in Settings.model_fields:
            parts.append(why)
            continue
        given = err.get("input")
        shown = f" = {given!r}" if isinstance(given, str | int | float) and name not in SECRET_SETTINGS else ""
        flag = f"--{name.replace('_', '-')}"
        parts.append(f"{name}{shown}: {why} (set by {flag + ', ' if flag in flags else ''}FRAGSEARCH_{name.upper()}, "
                     f".env or {config_file()})")
    return "bad setting " + "; ".join(parts)


def debug_requested() -> bool:
    """Whether FRAGSEARCH_DEBUG asks for tracebacks of known failures (`fragsearch --debug` does too). Read
    from the environment itself, not the settings: a broken settings file must not hide it."""
    return os.environ.get(DEBUG_VARIABLE, "").strip().lower() not in ("", "0", "false", "no", "off")
