"""The distribution as a user installs it: sdist and wheel built, the wheel installed in a
fresh virtual environment (dependencies from the package index), the command run."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir",
                        str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_wheel_and_sdist_carry_the_name_version_license_and_kernel(dist):
    import gemmd

    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    assert wheel.name.startswith(f"gemmd_gpu-{gemmd.__version__}-")
    assert sdist.name == f"gemmd_gpu-{gemmd.__version__}.tar.gz"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode())
    assert meta["Name"] == "gemmd-gpu" and meta["Version"] == gemmd.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert "gemmd/kernels/tiled_gemm.cu" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    extras = meta.get_all("Requires-Dist")
    assert any(r.startswith("cupy-cuda12x>=14") and 'extra == "cuda12"' in r
               for r in extras), extras
    assert any(r.startswith("cuda-toolkit[cublas,cudart,curand,nvrtc]==12.*")
               and 'extra == "cuda12"' in r for r in extras), extras
    with tarfile.open(sdist) as t:
        assert any(n.endswith("/LICENSE") for n in t.getnames())


def test_the_wheel_installs_in_a_fresh_venv_and_runs(dist, tmp_path):
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin/pip"), "install", "-q", str(wheel)],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    gemmd = venv / "bin/gemmd"
    r = subprocess.run([str(gemmd), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("gemmd "), r.stderr
    r = subprocess.run([str(gemmd), "check-config", str(ROOT / "gemmd.yaml")],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip().endswith(": OK"), r.stderr
    # The installed kernel source is found through the package, not the checkout.
    r = subprocess.run([str(venv / "bin/python"), "-c",
                        "from importlib import resources; print(resources.files("
                        "'gemmd.kernels').joinpath('tiled_gemm.cu').read_text()[:40])"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and "tiled GEMM" in r.stdout, r.stderr


@pytest.mark.parametrize("cuda", ["cuda12", "cuda13"])
def test_the_images_python_layer_resolves_to_its_lock(dist, tmp_path, cuda):
    """The image cannot be built here (no Docker daemon, no registry): its Python layer is
    resolved as the Dockerfile installs it, the wheel with the CUDA extra under the image's
    lock, against the package index (pip --dry-run: metadata only, ~1.5 GB not fetched).
    Every package lands at its pinned version, and no CUDA library gemmd does not load."""
    import json
    import os

    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    lock = ROOT / "requirements" / f"image-{cuda}.txt"
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_CONSTRAINT": str(lock)}
    r = subprocess.run([str(venv / "bin/pip"), "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(report), f"{wheel}[{cuda}]"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    pinned = lock.read_text()
    for name, version in got.items():
        if name != "gemmd-gpu":
            assert f"\n{name}=={version}" in pinned.lower(), (name, version)
    assert {"cupy-" + cuda + "x", "nvidia-ml-py", "scikit-learn"} <= set(got)
    assert not [n for n in got if any(u in n for u in ("cufft", "cusolver", "cusparse",
                                                       "nvjitlink"))]


def test_dockerfile_runs_the_wheel_as_65532_with_the_cuda_extra_and_a_healthcheck():
    """No Docker daemon or registry here to build it (the note says so); what the image
    does is pinned down here and by the fresh-venv install above, which it repeats."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert "USER 65532:65532" in lines
    assert ('PIP_CONSTRAINT=/tmp/constraints.txt pip install --no-cache-dir '
            '"$(ls /tmp/dist/gemmd_gpu-*.whl)[${CUDA}]"; \\') in lines
    assert "ARG CUDA=cuda12" in lines
    # At the versions of the image's lock (built and installed), one per CUDA extra.
    assert lines.count("COPY requirements/image-${CUDA}.txt /tmp/constraints.txt") == 2
    assert "PIP_CONSTRAINT=/tmp/constraints.txt pip wheel" in text
    for cuda in ("cuda12", "cuda13"):
        lock = (ROOT / "requirements" / f"image-{cuda}.txt").read_text()
        assert f"\ncupy-{cuda}x==" in lock and "\nsetuptools==" in lock
        # Only the CUDA libraries gemmd loads (sizes in docs/deploy.md).
        for unused in ("cufft", "cusolver", "cusparse", "nvjitlink"):
            assert f"\nnvidia-{unused}" not in lock, (cuda, unused)
        for used in ("cublas", "cuda-nvrtc", "cuda-runtime", "curand"):
            assert f"\nnvidia-{used}" in lock, (cuda, used)
    # The base is pinned by digest, in both stages; the image says what it is.
    assert re.search(r"^ARG BASE=python:3\.12-slim@sha256:[0-9a-f]{64}$", text, re.M)
    assert lines.count("FROM ${BASE} AS wheel") == 1 and lines.count("FROM ${BASE}") == 1
    assert not any(ln.startswith("FROM") and "${BASE}" not in ln for ln in lines)
    for key in ("title", "description", "version", "revision", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in text, key
    health = next(ln for ln in lines if ln.startswith("CMD [\"python\", \"-c\""))
    assert "/-/healthy" in health
    assert lines[-1] == ('CMD ["run", "--config", "/etc/gemmd/gemmd.yaml", "--state-dir", '
                         '"/var/lib/gemmd"]')
    # The DaemonSet runs the same user and paths.
    ds = (ROOT / "deploy/kubernetes/daemonset.yaml").read_text()
    assert "runAsUser: 65532" in ds and "mountPath: /var/lib/gemmd" in ds


def test_the_locks_pin_every_dependency_within_pyprojects_ranges():
    """requirements/*.txt (what `make test` and the image install) follow pyproject.toml: a
    dependency added or a range moved without `make lock UPGRADE=` fails here, not later as
    an unpinned install."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for lock, reqs in (("test.txt", project["dependencies"] + extras["test"]),
                       ("image-cuda12.txt", project["dependencies"] + extras["cuda12"]),
                       ("image-cuda13.txt", project["dependencies"] + extras["cuda13"])):
        pins: dict[str, list[str]] = {}
        for line in (ROOT / "requirements" / lock).read_text().splitlines():
            if "==" in line and not line.startswith((" ", "#")):
                name, version = line.split(";")[0].strip().split("==")
                pins.setdefault(canonicalize_name(name), []).append(version)
        for text in reqs:
            req = Requirement(text)
            versions = pins.get(canonicalize_name(req.name))
            assert versions, f"requirements/{lock} has no pin for {text!r}: make lock UPGRADE="
            assert all(v in req.specifier for v in versions), \
                f"requirements/{lock}: {req.name} {versions} outside {text!r}: make lock UPGRADE="
