"""The house's walls, read from every module's imports (its AST, every import statement, at module level
or in a function, and every `importlib.import_module("fabtrain...")` of a literal name):

- only the node runtime (fabtrain/node/) imports fabtrain.node: the controller, the dashboard, remote,
  plan and Slurm speak to it through fabtrain.contract, the vocabulary both sides import;
- the contract imports nothing of fabtrain but itself, and only the standard library;
- no module imports itself through others, however late (a circle hidden in a function is still one).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.support import REPO


def module_names(root: Path) -> dict[str, Path]:
    """Every module under root's parent's package `root.name`: dotted name -> file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path) -> set[str]:
    """Every module name the file at path imports (absolute, relative resolved), wherever the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.BinOp) and isinstance(node.args[0].left, ast.Constant)):
            found.add(str(node.args[0].left.value).rstrip("."))  # import_module("fabtrain.node." + name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (a package's __init__ counted as the package).

    A module's own packages are left out: they are initialised before it whatever it imports, and
    `from . import sibling` names its package only to reach the sibling."""
    modules = module_names(root)
    return {name: {m for m in imported(name, path) if m in modules and m != name and not name.startswith(m + ".")}
            for name, path in modules.items()}


def node_imports_outside(root: Path) -> list[str]:
    """"module: imports X" for every module outside root/node/ that imports the node runtime."""
    node, modules = f"{root.name}.node", module_names(root)
    return sorted(f"{name}: imports {m}" for name, path in modules.items()
                  if not (name == node or name.startswith(node + "."))
                  for m in sorted(imported(name, path)) if m in modules and (m == node or m.startswith(node + ".")))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import one another (Tarjan's strongly connected components), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(cycles)


FABTRAIN = REPO / "fabtrain"


def test_only_the_node_runtime_imports_the_node_runtime():
    assert node_imports_outside(FABTRAIN) == []


def test_the_contract_imports_only_itself_and_the_standard_library():
    contract = module_names(FABTRAIN / "contract")
    assert {"contract.states", "contract.events"} <= set(contract)
    for name, path in module_names(FABTRAIN).items():
        if name.startswith("fabtrain.contract"):
            for m in imported(name, path):
                top = m.split(".")[0]
                assert m.startswith("fabtrain.contract") or (top != "fabtrain" and top in sys.stdlib_module_names), \
                    f"{name} imports {m}"


def test_no_fabtrain_module_imports_itself_through_others():
    graph = import_graph(FABTRAIN)
    assert len(graph) > 100 and "fabtrain.node.ops" in graph["fabtrain.node.serve"] | graph["fabtrain.node.pod"]
    assert import_cycles(graph) == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checks_find_a_node_import_and_a_circle_however_it_is_written(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "", "node/__init__.py": "", "node/ops.py": "from pkg.node import atomic\n",
        "node/atomic.py": "", "node/history.py": "def f():\n    from . import ops\n",
        "controller/__init__.py": "",
        "controller/report.py": "def f():\n    from pkg.node.ops import X\n",
        "controller/views.py": "import importlib\nM = importlib.import_module('pkg.node.atomic')\n",
        "plan/__init__.py": "", "plan/a.py": "from pkg.plan import b\n",
        "plan/b.py": "def f():\n    from .a import x\n",  # a circle behind a function-level import
        "plan/c.py": "import importlib\ndef f(n):\n    return importlib.import_module('pkg.plan.' + n)\n",
        "plan/d.py": "from pkg.plan import c\n", "plan/e.py": "from . import a\n",
    })
    assert node_imports_outside(root) == ["pkg.controller.report: imports pkg.node.ops",
                                          "pkg.controller.views: imports pkg.node.atomic"]
    graph = import_graph(root)
    assert import_cycles(graph) == [["pkg.plan.a", "pkg.plan.b"]]
    (root / "node/atomic.py").write_text("from pkg.node import history\n")  # ops -> atomic -> history -> ops
    (root / "plan/__init__.py").write_text("from pkg.plan import e\n")  # the package's own import of its module
    graph = import_graph(root)
    assert graph["pkg.plan.e"] == {"pkg.plan.a"}
    assert import_cycles(graph) == [["pkg.node.atomic", "pkg.node.history", "pkg.node.ops"],
                                    ["pkg.plan.a", "pkg.plan.b"]]
