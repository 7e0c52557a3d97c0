"""The KubeRay manifests for one Ray version: the version is one build argument, shared with the image.

    python k8s/render.py --ray-version 2.55.0 --out build/k8s     # rayVersion and image tags set
    docker build -f k8s/Dockerfile --build-arg RAY_VERSION=2.55.0 -t <registry>/parquet-ray-pipeline:2.55.0-gpu .

(`make k8s RAY_VERSION=2.55.0` does both.) The committed manifests are the rendering for the Dockerfile's
default RAY_VERSION; the version must lie in pyproject.toml's Ray range (tests/test_k8s.py checks the
committed files and renderings for the oldest and newest supported Ray).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFESTS = ("rayjob-gpu.yaml", "raycluster.yaml")


def default_version() -> str:
    """The Dockerfile's `ARG RAY_VERSION=` default: the version the committed manifests are rendered for."""
    m = re.search(r"^ARG\s+RAY_VERSION=(\S+)\s*$", (HERE / "Dockerfile").read_text(), re.M)
    if not m:
        raise SystemExit("k8s/Dockerfile has no `ARG RAY_VERSION=<version>` line")
    return m.group(1)


def render(text: str, version: str) -> str:
    """A manifest with every rayVersion and every parquet-ray-pipeline image tag set to `version`."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise ValueError(f"Ray version {version!r} is not of the form X.Y.Z")
    text = re.sub(r'(rayVersion:\s*)"[^"]*"', rf'\g<1>"{version}"', text)
    return re.sub(r"(parquet-ray-pipeline:)\d+\.\d+\.\d+(-gpu)", rf"\g<1>{version}\g<2>", text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ray-version", default=default_version())
    p.add_argument("--out", default="build/k8s", help="folder for the rendered manifests")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in MANIFESTS:
        (out / name).write_text(render((HERE / name).read_text(), a.ray_version))
    print(f"wrote {', '.join(str(out / n) for n in MANIFESTS)} for Ray {a.ray_version}; build the image with\n"
          f"  docker build -f k8s/Dockerfile --build-arg RAY_VERSION={a.ray_version} "
          f"-t parquet-ray-pipeline:{a.ray_version}-gpu .")
    return 0


if __name__ == "__main__":
    sys.exit(main())
