"""The package's import structure: one direction, no circles (deferred imports count)."""

import ast
import pathlib
import subprocess
import sys
from typing import Dict, List, Set

import vistrain

ROOT = pathlib.Path(vistrain.__file__).parent

# Lowest first. A package may import packages of its own layer or below, never above.
LAYERS: List[Set[str]] = [
    {"vistrain", "torch_compat", "config"},
    {"distributed"},
    {"fsdp"},
    {"models", "data"},
    {"losses", "optim"},
    {"methods"},  # each method's criterion, head and config section; a run's config with their keys
    {"checkpoint"},
    {"runtime"},
    {"planner"},
    {"training", "benchmarks", "integrations"},
    {"jobs", "cli"},
]


def _module_name(path: pathlib.Path) -> str:
    parts = ("vistrain", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Dict[str, pathlib.Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py") if "configs" not in p.parts}


def _typing_only(tree: ast.Module) -> Set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``: annotations, never run (a typed
    back-reference such as a unit's ``ModelState`` is not a dependency)."""
    blocks = [
        n for n in ast.walk(tree) if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"
    ]
    return {id(node) for block in blocks for stmt in block.body for node in ast.walk(stmt)}


def _imports(path: pathlib.Path, modules: Dict[str, pathlib.Path]) -> Set[str]:
    """Every vistrain module ``path`` imports, at module level or inside functions."""
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vistrain"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vistrain"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return found


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "vistrain"
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def _find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}  # 1 on the current path, 2 done
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages <= set().union(*LAYERS), packages - set().union(*LAYERS)


def test_no_import_cycles_even_deferred():
    assert _find_cycle(_graph()) == []


def test_no_package_imports_a_higher_layer():
    upward = [f"{a} -> {b}" for a, targets in _graph().items() for b in targets if _layer(b) > _layer(a)]
    assert upward == []


def test_the_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) == []


def test_job_registry_holds_functions_whatever_the_import_order():
    """Importing the benchmarks first once left module objects in the registry (an import circle)."""
    probe = (
        "import vistrain.benchmarks, vistrain.training; from vistrain.jobs import JOBS, get_job; "
        "import types; assert all(callable(f) and not isinstance(f, types.ModuleType) for f in JOBS.values()); "
        "assert get_job('knn').__module__ == 'vistrain.benchmarks.knn'"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
