"""The layering rules, checked on the source (docs/architecture.md draws them).

Each package imports only the packages below it: the shared leaf (``core``) nothing of the project;
the in-rank wire (``telemetry/wire``) only the leaf; the detectors only the leaf; the service the
detectors and the leaf, never the reverse; the test bed what it trains and scores; the composition
root (``sdcwatch/``: CLI, config, serve, demo, report) anything. No two modules import each other,
directly or round a loop; no function in product code is over 80 lines; no module over 600.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: import name -> folder, for every package of the project (the composition root last: it is the rest)
PACKAGES = {
    "sdcwatch.core": "core",
    "sdcwatch.telemetry.wire": "telemetry/wire",
    "sdcwatch.telemetry.probes": "telemetry/probes",
    "sdcwatch.telemetry.guard": "telemetry/guard",
    "sdcwatch.telemetry.integrations": "telemetry/integrations",
    "sdcwatch.telemetry": "telemetry",
    "sdcwatch.detectors": "detectors",
    "sdcwatch.service": "service",
    "sdcwatch.exporters": "exporters",
    "sdcwatch.testbed": "testbed",
    "sdcwatch": "sdcwatch",
}

#: package -> the project packages its modules may import besides its own
ALLOWED: dict[str, tuple[str, ...]] = {
    "sdcwatch.core": (),
    "sdcwatch.telemetry.wire": ("sdcwatch.core",),
    "sdcwatch.telemetry.probes": ("sdcwatch.core", "sdcwatch.telemetry.wire"),
    "sdcwatch.telemetry.guard": ("sdcwatch.core", "sdcwatch.telemetry.wire"),
    "sdcwatch.telemetry.integrations": (
        "sdcwatch.core",
        "sdcwatch.telemetry.wire",
        "sdcwatch.telemetry.probes",
        "sdcwatch.telemetry.guard",
    ),
    # the package's own __init__: the public names of its sub-packages
    "sdcwatch.telemetry": (
        "sdcwatch.core",
        "sdcwatch.telemetry.wire",
        "sdcwatch.telemetry.probes",
        "sdcwatch.telemetry.guard",
    ),
    "sdcwatch.detectors": ("sdcwatch.core",),
    "sdcwatch.service": ("sdcwatch.core", "sdcwatch.detectors"),
    "sdcwatch.exporters": ("sdcwatch.core",),
    "sdcwatch.testbed": (
        "sdcwatch.core",
        "sdcwatch.telemetry",
        "sdcwatch.telemetry.wire",
        "sdcwatch.telemetry.probes",
        "sdcwatch.telemetry.guard",
        "sdcwatch.detectors",
        "sdcwatch.service",
        "sdcwatch.exporters",  # the campaign's guarded runs hand decisions to the control sink
    ),
    "sdcwatch": tuple(PACKAGES),
}

#: product code: what the wheel installs
PRODUCT_FOLDERS = ("core", "telemetry", "detectors", "service", "exporters", "testbed", "sdcwatch")

#: The most lines a function of product code may have: one that does more is several functions.
MAX_FUNCTION_LINES = 80
#: The most lines a module of product code may have: past it, a module owns more than one concept.
MAX_MODULE_LINES = 600


def _modules() -> dict[str, Path]:
    """Every module of the project by its import name."""
    out: dict[str, Path] = {}
    for name, folder in PACKAGES.items():
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT / folder).with_suffix("")
            parts = [] if rel.name == "__init__" and rel.parent == Path(".") else list(rel.parts)
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            dotted = ".".join([name, *parts])
            out.setdefault(dotted, p)  # a sub-package's own entry wins over its parent folder's walk
    return out


MODULES = _modules()


def _package_of(module: str) -> str:
    return max((p for p in PACKAGES if module == p or module.startswith(p + ".")), key=len)


def _runtime_imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Every project module ``path`` imports when it runs (imports inside functions count: they run
    too), with the line; imports under ``if TYPE_CHECKING:`` do not run and are left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("sdcwatch")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            if not base.startswith("sdcwatch"):
                continue
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else base))
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_packages_below_it(package):
    allowed = ALLOWED[package]
    mine = [m for m in MODULES if _package_of(m) == package]
    assert mine, f"no modules in {package}"
    bad = []
    for m in mine:
        for line, target in _runtime_imports(MODULES[m], m):
            theirs = _package_of(target)
            if theirs != package and theirs not in allowed:
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{line} imports {target} ({theirs})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    """No module imports one that imports it back, directly or round a loop (lazy imports count, and
    so do a package's ``__init__``, the test bed and the campaign: the composition root imports them)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for m, p in MODULES.items():
        for _, target in _runtime_imports(p, m):
            if target in MODULES and target != m:
                graph[m].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _product_files() -> list[Path]:
    return [p for folder in PRODUCT_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


def test_no_function_in_product_code_is_over_the_bound():
    long = []
    for p in _product_files():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


def test_no_module_in_product_code_is_over_the_bound():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in _product_files()}
    over = [f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_MODULE_LINES]
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by concept):\n" + "\n".join(over)


def test_no_module_outside_a_package_init_re_exports_a_name():
    """A name is imported from the module that defines it: ``__all__`` of a plain module lists only
    what that module defines (a package's ``__init__`` is where re-exports live)."""
    bad = []
    for m, p in MODULES.items():
        if p.name == "__init__.py":
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"), str(p))
        defined = set()
        listed: list[str] = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    defined |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                    listed = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
        bad += [
            f"{p.relative_to(ROOT)} lists {name} in __all__ but does not define it"
            for name in listed
            if name not in defined
        ]
    assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own; one that others need is made public."""
    bad = []
    for p in _product_files():
        tree = ast.parse(p.read_text(encoding="utf-8"), str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sdcwatch"):
                bad += [
                    f"{p.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not bad, "\n".join(bad)


def test_every_module_is_in_a_package_the_wheel_installs():
    """pyproject.toml lists every package folder (a new sub-package not listed would be missing
    from the wheel)."""
    import tomllib

    listed: set[str] = set()
    # the base wheel's, and the campaign's (a distribution of its own: sdcwatch-campaign)
    for project in (ROOT / "pyproject.toml", ROOT / "testbed" / "campaign" / "pyproject.toml"):
        listed |= set(tomllib.loads(project.read_text())["tool"]["setuptools"]["packages"])
    found = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_test_modules_have_unique_names():
    """The test folders mirror the package folders, so two of them may hold a test of the same
    concept: pytest imports test modules by their base name, and a second one would not collect."""
    names: dict[str, list[str]] = defaultdict(list)
    for p in sorted((ROOT / "tests").rglob("*.py")):
        if p.name != "__init__.py" and p.name != "conftest.py":
            names[p.name].append(str(p.relative_to(ROOT)))
    twins = {n: ps for n, ps in names.items() if len(ps) > 1}
    assert not twins, f"test modules sharing a name: {twins}"
