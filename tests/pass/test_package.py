"""The package's shape: the product imports none of the offline tools, and the lazy names reach them."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import sparse_fx
from support import ROOT


def test_import_sparse_fx_loads_no_offline_tool_and_the_lazy_names_reach_them():
    code = (
        "import sys, sparse_fx\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('sparse_fx.offline'))\n"
        "assert not loaded, loaded\n"
        "from sparse_fx.offline.calibrate import calibrate\n"
        "from sparse_fx.offline.train import train_signatures\n"
        "assert sparse_fx.calibrate is calibrate and sparse_fx.train_signatures is train_signatures\n"
        "try:\n"
        "    sparse_fx.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


FRONT_END = ROOT / "sparse_fx"


def _imports(path: Path) -> set[str]:
    """The sparse_fx front-end modules `path` imports anywhere (lazily too), but for type checking."""
    package = ".".join(path.relative_to(FRONT_END.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    found = set()
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom):
            continue
        base = package.split(".")[: len(package.split(".")) - node.level] if node.level else []
        module = ".".join(base + ([node.module] if node.module else []))
        names = [module] + [f"{module}.{a.name}" for a in node.names]
        found |= {n for n in names if n.startswith("sparse_fx.") and _file(n)}
    return found


def _file(module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for candidate in (FRONT_END / rel.with_suffix(".py"), FRONT_END / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_the_front_end_has_no_import_cycle_and_plan_names_no_method():
    files = [p for p in FRONT_END.rglob("*.py") if "offline" not in p.parts]
    names = {p: ".".join(p.relative_to(FRONT_END.parent).with_suffix("").parts).removesuffix(".__init__") for p in files}
    graph = {names[p]: {i.removesuffix(".__init__") for i in _imports(p)} - {names[p]} for p in files}
    for module, deps in graph.items():  # a module's package imports it: the package is no cycle of its own
        graph[module] = {d for d in deps if not module.startswith(d + ".")}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(m):] + [m])}")
        if m in done:
            return
        path.append(m)
        for d in sorted(graph.get(m, ())):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    plan = (FRONT_END / "plan.py").read_text().lower()  # a method named in a string or a plan name
    named = [m.name for m in sparse_fx.methods.registered() if m.name != "dense"
             and re.search(rf"[\"'`]{m.name}\b|\b{m.name}-|\b{m.name}\.", plan)]
    assert not named
    assert not any(_imports(p) & {"sparse_fx.offline"} for p in files)


def test_tests_mirror_the_tree_and_share_helpers_only_through_support():
    tests = ROOT / "tests"
    assert {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))} == {
        "ops", "pass", "methods", "generate", "offline", "bench"}
    assert sorted(p.name for p in tests.glob("*.py")) == ["conftest.py", "support.py"]
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(
                node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0].startswith("test_")], f"{path} imports a test module"
