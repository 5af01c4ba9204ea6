"""The import graph of src/loomtrain (issue 25, point 4): no cycle between modules, the lower
layers (comm/, models/, data/, mesh.py, parallel/) import nothing from the run loop, the CLI or
the technique packages above them, and no private `_name` crosses a top-level package.

The graph is read with `ast`, without importing anything: every `import` and `from ... import`
counts, at module level or inside a function (a lazy import is still a dependency; it only
hides a cycle until the day the function runs first). Relative imports are resolved, and
`from pkg import name` is an edge to `pkg.name` when `name` is a submodule, to `pkg` otherwise.
Imports built from strings at run time (`importlib.import_module(f"...{x}")`) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "loomtrain"

LOWER = ("comm", "models", "data", "mesh", "parallel")
UPPER = ("train", "cli", "lowcomm", "asyncsgd", "zeroth", "sparsity", "planner", "inference",
         "report", "timeline", "gantt")


def module_names(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its
    `__init__.py`)."""
    modules = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for every import of a loomtrain module in `path`.
    The name is the one bound by `from X import name` when `name` is not a submodule."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path).split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.append((submodule, "") if submodule in modules else (target, alias.name))
    return [(target, name) for target, name in found
            if target == ROOT or target.startswith(ROOT + ".")]


def import_graph(src: Path = SRC) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(edges: module -> the loomtrain modules it imports, imports: (importer, module, name))."""
    modules = module_names(src)
    edges, imports = {m: set() for m in modules}, []
    for module, path in modules.items():
        for target, name in imports_of(module, path, modules):
            assert target in modules, f"{module} imports {target}, which is no module of {ROOT}"
            if target != module:
                edges[module].add(target)
            imports.append((module, target, name))
    return edges, imports


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def cycle_in(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest cycle through the component's first module, as [a, b, ..., a]
    (breadth-first within the component)."""
    members, start = set(component), component[0]
    parent, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & members):
                if child == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def cycles(edges: dict[str, set[str]]) -> list[str]:
    return [" -> ".join(cycle_in(c, edges)) + f"  (all of: {', '.join(c)})"
            for c in strongly_connected(edges)]


def top_package(module: str) -> str:
    """`loomtrain.train.trainer` -> `train`; `loomtrain.cli` -> `cli`; `loomtrain` -> ``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def in_layer(module: str, packages: tuple[str, ...]) -> bool:
    return top_package(module) in packages


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{importer} -> {imported}" for importer, targets in edges.items()
                  if in_layer(importer, LOWER)
                  for imported in targets if in_layer(imported, UPPER))


def private_imports(imports: list[tuple[str, str, str]]) -> list[str]:
    return sorted(f"{importer} imports {name or imported} from {imported}"
                  for importer, imported, name in imports
                  if top_package(importer) != top_package(imported)
                  and (is_private(name) or any(map(is_private, imported.split(".")))))


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_graph_sees_known_edges(graph):
    """The builder finds edges the checks below depend on: `from loomtrain import comm` (a
    submodule by name), a module-level `from X import name`, and an import inside a function
    (train/run.py imports the zeroth-order loop only when chosen)."""
    edges, imports = graph
    assert "loomtrain.comm" in edges["loomtrain.train.trainer"]
    assert ("loomtrain.train.backprop", "loomtrain.train.apply", "build_run") in imports
    assert "loomtrain.zeroth.train" in edges["loomtrain.train.run"]
    assert len(edges) > 100 and sum(map(len, edges.values())) > 300


def test_checks_fail_on_a_package_that_breaks_each_rule(tmp_path):
    """A made-up package with a relative, a lazy and a private import: each check finds its
    case, so none of the tests below passes because it cannot fail."""
    package = tmp_path / ROOT
    (package / "comm").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "comm" / "__init__.py").write_text("from . import ring\n")
    (package / "comm" / "ring.py").write_text(
        "def f():\n    from ..train import _secret\n    from loomtrain import comm\n")
    (package / "train.py").write_text("from .comm.ring import f\n_secret = 1\n")
    edges, imports = import_graph(tmp_path)
    assert edges == {"loomtrain": set(), "loomtrain.comm": {"loomtrain.comm.ring"},
                     "loomtrain.comm.ring": {"loomtrain.train", "loomtrain.comm"},
                     "loomtrain.train": {"loomtrain.comm.ring"}}
    assert cycles(edges) == [
        "loomtrain.comm -> loomtrain.comm.ring -> loomtrain.comm"
        "  (all of: loomtrain.comm, loomtrain.comm.ring, loomtrain.train)"]
    assert upward_imports(edges) == ["loomtrain.comm.ring -> loomtrain.train"]
    assert private_imports(imports) == ["loomtrain.comm.ring imports _secret from loomtrain.train"]


def test_no_import_cycle(graph):
    edges, _ = graph
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(found)


def test_lower_layers_import_nothing_above_them(graph):
    edges, _ = graph
    upward = upward_imports(edges)
    assert not upward, (f"{', '.join(LOWER)} must not import from {', '.join(UPPER)}:\n"
                        + "\n".join(upward))


def test_no_private_name_crosses_top_level_packages(graph):
    _, imports = graph
    private = private_imports(imports)
    assert not private, "private names imported across top-level packages:\n" + "\n".join(private)
