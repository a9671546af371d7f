"""Print the runtime requirements of the services, one pin a line, from pyproject.toml's
[project].dependencies (no dev extras). Used by the image build and by docker/wheelhouse.sh, so the
images install exactly the versions the repository pins.

`python3 docker/requirements.py [pyproject.toml] [--torch-local cpu]`: with --torch-local, the torch
pin gets that local version label (torch==2.13.0+cpu), which selects the CPU wheel."""

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, torch_local: str = "") -> list[str]:
    pins = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    if torch_local:
        pins = [f"{p}+{torch_local}" if p.startswith("torch==") else p for p in pins]
    return pins


if __name__ == "__main__":
    args = sys.argv[1:]
    local = ""
    if "--torch-local" in args:
        i = args.index("--torch-local")
        local = args[i + 1]
        del args[i : i + 2]
    path = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "pyproject.toml"
    print("\n".join(requirements(path, local)))
