"""The light image, built for real: a virtual environment with exactly what docker/Dockerfile's
build-light stage installs (its own requirement filter, run on pyproject.toml, then the project without
dependencies), in which every role the chart gives the light image must pass `rlfabric serve ROLE --check`
with the chart's config. It found that accelerate (which requires torch) pulled the 5 GB CUDA torch into
the "light" image. The train and rollout images are the project with and without the vllm extra, which
this machine's venv is; tests/deploy/test_helm.py checks their roles with vllm made unimportable.
About 75 s (pip downloads ~150 MB)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import tomllib
import yaml

from tests.deploy.test_helm import (
    CHART,
    DOCKERFILE,
    FULLNAME,
    REPO,
    ROLES,
    helm,
    parse_manifests,
    render_chart,
)

pytestmark = pytest.mark.slow


def build_light_stage() -> tuple[str, str]:
    """The build-light stage's requirement filter (its `python -c` program) and LIGHT_EXCLUDE's default."""
    stage = DOCKERFILE.read_text().split("AS build-light", 1)[1].split("\nFROM ", 1)[0]
    exclude = re.search(r"^ARG LIGHT_EXCLUDE=(\S+)", stage, re.MULTILINE).group(1)
    program = re.search(r'RUN python -c "(.+?)" \\\n', stage).group(1)
    return program, exclude


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory) -> Path:
    """/opt/venv of the light image: the Dockerfile copies pyproject.toml, README and services/, runs its
    filter, installs the requirements and then the project alone."""
    root = tmp_path_factory.mktemp("light-image")
    source = root / "src"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copy(REPO / "README.md", source)
    shutil.copytree(REPO / "services", source / "services", ignore=shutil.ignore_patterns("__pycache__"))
    program, exclude = build_light_stage()
    requirements = subprocess.run([sys.executable, "-c", program, exclude], cwd=source,
                                  capture_output=True, text=True, check=True).stdout
    (root / "requirements-light.txt").write_text(requirements)
    venv.create(root / "venv", with_pip=True)
    # --no-compile: what is installed is the same; only the .pyc files of every installed module (most of which
    # no test here imports) are not written ahead of time.
    pip = [str(root / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "--no-compile"]
    for args in (["--requirement", str(root / "requirements-light.txt")], ["--no-deps", str(source)]):
        done = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    return root / "venv"


def test_the_light_image_holds_no_torch(light_venv):
    program, exclude = build_light_stage()
    assert set(exclude.split(",")) >= {"torch", "accelerate", "peft"}
    done = subprocess.run([str(light_venv / "bin" / "python"), "-c", "import torch"], capture_output=True, text=True)
    assert "No module named 'torch'" in done.stderr, done.stderr
    listed = subprocess.run([str(light_venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True).stdout.lower()
    assert not re.search(r"^(torch|nvidia-[a-z0-9-]+|triton)==", listed, re.MULTILINE), listed


def light_roles(values: dict) -> list[str]:
    return [role for role in ROLES if values["roles"][role]["image"]["variant"] == "light"]


def test_every_role_of_the_light_image_builds_in_it(light_venv, tmp_path):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    roles = light_roles(values)
    assert roles == ["reward", "env"]
    with helm.Chart.load(CHART) as chart:
        docs = parse_manifests(render_chart(chart, {}))
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{FULLNAME}-config"]
    config = tmp_path / "config.yaml"
    config.write_text(config_map["data"]["config.yaml"])
    for role in roles:
        done = subprocess.run([str(light_venv / "bin" / "rlfabric"), "serve", role, "--config", str(config), "--check"],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, f"{role}: {done.stdout[-1000:]}{done.stderr[-3000:]}"
        assert "ready to serve" in done.stdout


def test_every_subpackage_of_the_source_tree_is_packaged():
    """pyproject lists the packages by hand: a role folder missing from it imports from the checkout
    (the editable install) but not from an image's installed wheel."""
    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"rlfabric." + ".".join(init.parent.relative_to(root / "services").parts)
               for init in (root / "services").rglob("__init__.py") if init.parent != root / "services"}
    assert on_disk - listed == set(), f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
