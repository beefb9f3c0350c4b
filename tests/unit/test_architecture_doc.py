"""docs/architecture.md names real code: every file path (`rft_hpc/buffer/writer.py`), every
qualified name after one (`rft_hpc/buffer/writer.py:SegmentWriter.write_step`), every
callable written with parentheses (`run_explorer()`, `SegmentWriter.write_step()`) and every
class name (`BufferReader`) in its code spans exists in the package. A rename or a removal
that leaves the page behind fails here, with the names that went missing.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache

from helpers.paths import ROOT

DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "rft_hpc"

SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^(?P<path>[\w/.-]+\.(?:py|toml|sh|sbatch))(?::(?P<name>[\w.]+))?$")
CALL = re.compile(r"^(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\(\)$")
CLASS = re.compile(r"^[A-Z][a-z]+(?:[A-Z][a-z0-9]*)+$")  # CamelCase of two words or more


@cache
def definitions() -> dict[str, list[str]]:
    """Top-level classes and functions of the package: name -> the modules defining it."""
    found: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                found.setdefault(node.name, []).append(module)
    return found


def resolves(module: str, qualname: str) -> bool:
    """`qualname` (`Class.method` or `function`) is an attribute path of `module`."""
    obj = importlib.import_module(module.removesuffix(".__init__"))
    for part in qualname.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def missing(span: str) -> str | None:
    """Why `span` names nothing that exists (None: it exists, or it is not a code name)."""
    if m := PATH.match(span):
        path = m["path"]
        file = next((p for p in (ROOT / path, PACKAGE / path) if p.is_file()), None)
        if file is None:
            return f"no file {path}"
        if m["name"]:
            module = ".".join(file.relative_to(ROOT).with_suffix("").parts)
            return None if resolves(module, m["name"]) else f"no {m['name']} in {path}"
        return None
    name = m["name"] if (m := CALL.match(span)) else span if CLASS.match(span) else None
    if name is None:
        return None
    head, _, rest = name.partition(".")
    modules = definitions().get(head, [])
    if not modules:
        return f"nothing in rft_hpc defines {head}"
    if rest and not any(resolves(mod, name) for mod in modules):
        return f"{head} has no {rest}"
    return None


def test_every_name_in_the_architecture_page_exists() -> None:
    spans = SPAN.findall(DOC.read_text())
    checked = [s for s in spans if PATH.match(s) or CALL.match(s) or CLASS.match(s)]
    assert len(checked) >= 40, f"the page names only {len(checked)} pieces of code"
    problems = sorted({f"`{s}`: {why}" for s in spans if (why := missing(s))})
    assert not problems, "docs/architecture.md names code that does not exist:\n" + \
        "\n".join(problems)


def test_the_check_catches_a_name_that_does_not_exist() -> None:
    assert missing("rft_hpc/buffer/no_such_module.py") == "no file rft_hpc/buffer/no_such_module.py"
    assert missing("rft_hpc/buffer/writer.py:SegmentWriter.no_such_method") is not None
    assert missing("explore_everything()") == "nothing in rft_hpc defines explore_everything"
    assert missing("SegmentWriter.write_step()") is None
    assert missing("BufferReader") is None
    assert missing("sync.interval") is None  # a config key, not a code name
