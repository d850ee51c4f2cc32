"""The layering rule, checked on the source: the shared leaf imports nothing of the project, and the
in-rank package, the detector service and the exporters import nothing of each other (what crosses
between them lives in ``sdcwatch.core``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: package folder -> the project packages its modules may import besides its own
ALLOWED = {
    "sdcwatch/core": (),
    "telemetry": ("sdcwatch.core",),
    "detectors": ("sdcwatch.core",),
    "exporters": ("sdcwatch.core",),
}
OWN = {
    "sdcwatch/core": "sdcwatch.core",
    "telemetry": "sdcwatch.telemetry",
    "detectors": "sdcwatch.detectors",
    "exporters": "sdcwatch.exporters",
}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node in ast.walk(tree):  # every import, also those inside functions (lazy imports count)
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_a_package_imports_only_itself_and_the_shared_core(folder):
    own, allowed = OWN[folder], ALLOWED[folder]
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no modules under {folder}"
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in files
        for line, mod in _imports(p)
        if mod.split(".")[0] == "sdcwatch"
        and not mod.startswith(own)
        and not any(mod == a or mod.startswith(a + ".") for a in allowed)
    ]
    assert not bad, "\n".join(bad)


#: The most lines a module of these packages may have: small modules that each own one thing.
MAX_LINES = 450


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_no_module_is_over_the_line_bound(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no modules under {folder}"
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in files}
    over = [f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines (split them by the concepts they own):\n" + "\n".join(over)


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own; one that others need is made public."""
    bad = []
    for top in ("sdcwatch", "telemetry", "detectors", "exporters", "testbed"):
        for p in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(p.read_text(encoding="utf-8"), str(p))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sdcwatch"):
                    bad += [
                        f"{p.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                        for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                    ]
    assert not bad, "\n".join(bad)
