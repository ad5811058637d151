"""CI: `.ci/run` installs Chromium and runs the README's test command with CI=true, under which a test
marked `required` (the browser tests) fails where what it needs is missing instead of being skipped
(tests/conftest.py); then the tests marked `slow` and `milvus_server` that the suite leaves out
(docs/operations/testing.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
# the long process-killing trials
SLOW = './run python -m pytest -m slow tests/test_crash.py tests/test_image.py -k "not many_times"'
# the Milvus backend against a real server, in a network namespace of its own
MILVUS_SERVER = "./run python -m pytest -m milvus_server tests/test_milvus_server.py"


def test_ci_installs_chromium_and_runs_the_readmes_test_command_under_ci() -> None:
    usage = re.search(r"^    (\./run test)\s+# .*test suite", (ROOT / "README.md").read_text(), re.M)
    assert usage, "the README names its test command in its first lines"
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    code = [line for line in lines if line and not line.startswith("#")]
    assert usage.group(1) in code, "CI runs the README's test command"
    suite = code.index(usage.group(1))
    assert [line.split("#")[0].strip() for line in code[suite + 1 :]] == [SLOW, MILVUS_SERVER], \
        "after the README's test command CI runs only the slow and Milvus-server checks the suite leaves out"
    assert "export CI=true" in code[:suite]
    assert any("apt-get install" in line and "chromium" in line for line in code)


def test_a_required_test_that_cannot_run_fails_under_ci_and_is_skipped_elsewhere(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_needs='''
        import pytest

        @pytest.mark.required(False, reason="the tool is absent")
        def test_without_the_tool():
            pass

        @pytest.mark.required(True, reason="the tool is absent")
        def test_with_the_tool():
            pass
    ''')
    monkeypatch.delenv("CI", raising=False)
    here = pytester.runpytest("-p", "tests.conftest")
    here.assert_outcomes(passed=1, skipped=1)
    monkeypatch.setenv("CI", "true")
    ci = pytester.runpytest("-p", "tests.conftest")
    ci.assert_outcomes(passed=1, errors=1)  # failed in its set-up, before any fixture is made
    assert ci.ret == pytest.ExitCode.TESTS_FAILED
    ci.stdout.fnmatch_lines(["*test_without_the_tool*required test cannot run under CI: the tool is absent*"])
