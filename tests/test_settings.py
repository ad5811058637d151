"""Settings from flags, the environment, .env and fragsearch.toml (pydantic-settings), each over the next;
a flag for every setting in `python -m fragsearch.service --help`; the settings table docs/operations/settings.md
generated
from the model."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from fragsearch.commands.options import settings_from, settings_markdown, settings_parser
from fragsearch.commands.prepare import main as prepare_main
from fragsearch.commands.serve import main as service_main
from fragsearch.settings import CONCERNS, Settings, SettingsFileError

ROOT = Path(__file__).resolve().parent.parent
USED = ("PORT", "HEAVY_SLOTS", "LOG_FORMAT", "CONFIG", "PREPARE", "CORS_ORIGINS")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A working folder of the test's own (no .env, no fragsearch.toml) and none of the variables used."""
    monkeypatch.chdir(tmp_path)
    for name in USED:
        monkeypatch.delenv(f"FRAGSEARCH_{name}", raising=False)


def from_flags(*flags: str) -> Settings:
    ap = settings_parser()
    return settings_from(ap, ap.parse_args(list(flags)))


def test_the_settings_table_is_generated_from_the_model() -> None:
    table = (ROOT / "docs" / "operations" / "settings.md").read_text()
    assert table == settings_markdown(), \
        "docs/operations/settings.md is stale: python -m fragsearch.service.settings --markdown"
    for name in Settings.model_fields:
        assert f"| `{name}` | `--{name.replace('_', '-')}" in table, name


def test_each_setting_has_one_concern() -> None:
    """The concerns (paths, model, collection, index, serving, limits) divide the settings: each setting is in
    exactly one, and the table and --help show it under that one."""
    placed = [name for names in CONCERNS.values() for name in names]
    assert sorted(placed) == sorted(Settings.model_fields)
    assert len(placed) == len(set(placed))
    table = settings_markdown()
    assert table.index("## Paths") < table.index("| `cache` |") < table.index("## Model")
    assert table.index("## Limits") < table.index("| `max_pixels` |")
    help_text = settings_parser().format_help()
    assert help_text.index("paths settings:") < help_text.index("\n  --cache ") < help_text.index("model settings:")
    assert help_text.index("limits settings:") < help_text.index("\n  --max-pixels ")


def test_help_lists_a_flag_for_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        service_main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    missing = [name for name in Settings.model_fields if f"--{name.replace('_', '-')}" not in out]
    assert missing == [] and "--config FILE" in out and "--no-prepare" in out


def test_each_source_over_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fragsearch.toml").write_text('port = 8101\nheavy_slots = 3\nlog_format = "json"\n'
                                              'cors_origins = ["https://a.example"]\nprepare = false\n')
    s = Settings()
    assert (s.port, s.heavy_slots, s.log_format, s.cors_origins, s.prepare) == (
        8101, 3, "json", ["https://a.example"], False)
    (tmp_path / ".env").write_text("FRAGSEARCH_PORT=8102\n")
    assert (Settings().port, Settings().heavy_slots) == (8102, 3)  # .env over the file
    monkeypatch.setenv("FRAGSEARCH_PORT", "8103")
    assert Settings().port == 8103  # the environment over .env
    s = from_flags("--port", "8104", "--prepare", "--cors-origins", "https://b.example")
    assert (s.port, s.heavy_slots, s.prepare, s.cors_origins) == (8104, 3, True, ["https://b.example"])
    assert from_flags().port == 8103 and from_flags("--no-prepare").prepare is False


def test_config_names_another_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site.toml"
    site.write_text("port = 8201\n")
    assert from_flags("--config", str(site)).port == 8201
    monkeypatch.setenv("FRAGSEARCH_CONFIG", str(site))
    assert Settings().port == 8201
    monkeypatch.setenv("FRAGSEARCH_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(SettingsFileError, match="missing.toml not found"):
        Settings()


@pytest.mark.parametrize(("text", "error"), [
    ("prot = 8000\n", "prot is not a setting"),
    ("port = 8000\nheavy_slot = 2\nwarm_up = false\n", "heavy_slot, warm_up are not settings"),
    ("port = \n", "not valid TOML"),
])
def test_a_bad_settings_file_is_an_error_not_ignored(text: str, error: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fragsearch.toml").write_text(text)
    with pytest.raises(SettingsFileError, match=error):
        Settings()
    with pytest.raises(SystemExit) as stop:  # python -m fragsearch.service: argparse's one-line error, status 2
        from_flags()
    assert stop.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--port", "70000"], ["--heavy-slots", "0"], ["--log-format", "xml"],
                                   ["--port", "eighty"]])
def test_a_bad_flag_value_exits_with_a_message(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        from_flags(*flags)
    err = capsys.readouterr().err  # the flag (argparse: a value of the wrong kind) or the setting (a bound) named
    assert stop.value.code == 2 and (f"argument {flags[0]}:" in err or flags[0][2:].replace("-", "_") in err)


def test_the_parser_takes_flags_of_its_caller() -> None:
    ap = settings_parser("python -m fragsearch.service")
    ap.add_argument("--version", action="version", version="x")
    assert isinstance(ap, argparse.ArgumentParser)
    assert settings_from(ap, ap.parse_args(["--host", "0.0.0.0"])).host == "0.0.0.0"


def test_prepare_takes_the_same_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """python -m fragsearch.service.prepare: --help lists a flag for every setting; a flag wins over the environment
    and the settings file and reaches the preparation; a bad value exits with argparse's message."""
    with pytest.raises(SystemExit) as stop:
        prepare_main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fragsearch.service.prepare")
    missing = [name for name in Settings.model_fields if f"--{name.replace('_', '-')}" not in out]
    assert missing == [] and "--config FILE" in out

    (tmp_path / "fragsearch.toml").write_text(f'data = "{tmp_path / "from-file"}"\n')
    monkeypatch.setenv("FRAGSEARCH_DATA", str(tmp_path / "from-env"))
    flagged = tmp_path / "from-flag"
    flagged.mkdir()  # no images/ in it: the preparation stops there, before any work
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:  # main configures the root logger (to this test's captured standard error): put it back after
        code = prepare_main(["--data", str(flagged), "--artifacts", str(tmp_path / "artifacts"), "--device", "cpu",
                             "--limit", "3", "--workers", "1", "--log-format", "json"])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert code == 2
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    messages = [(line["level"], line["message"]) for line in lines if line["logger"] == "fragsearch.service.prepare"]
    assert messages[0] == ("INFO", f"preparing on cpu with 1 extraction workers: data {flagged}, artifacts "
                                   f"{tmp_path / 'artifacts'}, the first 3 images of each split"), messages
    errors = [m for lv, m in messages if lv == "ERROR"]
    assert len(errors) == 1 and "cannot prepare" in errors[0] and str(flagged) in errors[0], errors
    assert not (tmp_path / "artifacts" / "models").exists()  # nothing was prepared

    with pytest.raises(SystemExit) as stop:
        prepare_main(["--limit", "0"])
    assert stop.value.code == 2 and "limit" in capsys.readouterr().err
