"""The Milvus backend against a real Milvus 2.3.5 standalone server (the `milvus` package of the dev lock).

The server listens on every interface it sees, so its tests (tests/milvus_server_cases.py) run in a
pytest of their own inside a new network namespace whose only link is loopback (bench.milvus_local):
the server, the tests that talk to it and the writer processes they kill share that loopback, and no
packet reaches a real interface. Marked `milvus_server`, deselected by default; `.ci/run` runs them:

    ./run python -m pytest -m milvus_server tests/test_milvus_server.py

The server's version decides how candidates are grouped by item; that choice is tested here too,
without a server.
"""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bench.milvus_local import isolated, namespaces_work, own_namespace
from fragsearch.index.milvus import GROUPING_SERVER, MIN_SERVER, groups_on_server, parse_version
from tests.conftest import in_ci

ROOT = Path(__file__).resolve().parent.parent
CASES = Path(__file__).with_name("milvus_server_cases.py")
TIMEOUT = 1500  # seconds for the whole run in the namespace (the suite's small model is trained first)


def case_names() -> set[str]:
    """The tests of the cases module: its own and those it imports from the service suite."""
    tree = ast.parse(CASES.read_text())
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names.update(a.name for a in node.names if a.name.startswith("test_"))
    return names


def test_server_versions_decide_where_candidates_are_grouped() -> None:
    server = "http://milvus:19530"
    assert parse_version("v2.3.5-lite") == (2, 3, 5) and parse_version("2.4") == (2, 4, 0)
    assert parse_version("unknown") is None
    assert not groups_on_server(server, "v2.3.5-lite")  # 2.3 ignores group_by_field: grouped by the backend
    assert groups_on_server(server, "v2.4.0") and groups_on_server(server, "v2.6.1-gpu")
    assert not groups_on_server(server, "a build without a version")  # grouped by the backend: right anywhere
    assert groups_on_server("/data/milvus.db", "milvus_lite-3.2.2")  # milvus-lite groups
    with pytest.raises(ValueError, match=r"version v2\.2\.16; fragsearch needs a Milvus server 2\.3\.0 or newer"):
        groups_on_server(server, "v2.2.16")
    assert MIN_SERVER < GROUPING_SERVER


def test_the_server_is_never_started_outside_a_namespace_of_its_own(tmp_path: Path) -> None:
    from bench.milvus_local import LocalServer

    if isolated():
        pytest.skip("this process already runs in an isolated network namespace")
    with pytest.raises(RuntimeError, match="outside a network namespace of its own"):
        LocalServer(tmp_path / "m").start()
    assert not (tmp_path / "m").exists()


@pytest.mark.milvus_server
def test_the_backend_against_a_milvus_server_in_a_network_namespace_of_its_own(tmp_path: Path) -> None:
    why = namespaces_work()
    if why is not None:
        if in_ci():
            pytest.fail(f"the Milvus-server tests cannot run under CI: {why}", pytrace=False)
        pytest.skip(f"cannot make a network namespace here: {why}")
    report, log = tmp_path / "cases.xml", tmp_path / "cases.log"
    cmd = own_namespace([sys.executable, "-m", "pytest", str(CASES), "-m", "milvus_server", "-p", "no:cacheprovider",
                         "-v", "--durations=0", f"--junitxml={report}", f"--basetemp={tmp_path / 'run'}"])
    with open(log, "w") as out:
        # a session of its own: on a time-out its whole process group goes (the server and writers with it)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            pytest.fail(f"the Milvus-server tests did not finish within {TIMEOUT} s:\n{log.read_text()[-8000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything the run left behind
    output = log.read_text()[-12000:]
    assert returncode == 0, output
    cases = ET.parse(report).getroot().iter("testcase")
    passed = {c.get("name") for c in cases if not any(child.tag in ("failure", "error", "skipped") for child in c)}
    assert passed == case_names(), f"not passed: {sorted(case_names() - passed)}\n{output}"
