"""The source's layout: imports run one way (no circle) and no module is too long to read in one sitting.

The graph holds every `import frontier...` / `from frontier... import` (and hydra_plugins, kernels) statement,
at module level and inside functions alike: a lazy import is still a dependency.
"""
import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("frontier", "hydra_plugins", "kernels")
MAX_LINES = 600
TOO_LONG_ALLOWED: dict[str, str] = {}  # module -> why it cannot be split; keep it empty where possible


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports; `from package import module` counts as the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    found = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each as a circle to show."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_run_one_way():
    graph = import_graph()
    assert "frontier.lifecycle" in graph and graph["frontier.tracking"], "the graph found no modules or imports"
    circles = cycles(graph)
    shown = "; ".join(" <-> ".join(circle) for circle in circles)
    assert not circles, f"import circle(s): {shown} (a lower module must not import a higher one, not even lazily)"


def test_no_module_is_over_600_lines():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES and name not in TOO_LONG_ALLOWED}
    assert not long, f"modules over {MAX_LINES} lines: {long}; split them by job"
