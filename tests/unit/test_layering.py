"""How the modules of `jobs/` and `udfs/` may depend on each other, read from their source (AST).

- The job's own path never stands on development tooling: no module of `udfs/`, or of `jobs/`
  outside `jobs/dev/`, imports `jobs.dev`, at module level or inside a function, except the face
  (`jobs/cli.py` registers the dev commands, `jobs/demo.py` starts throwaway services).
- No import cycle among `jobs/` and `udfs/` modules (imports inside ``if TYPE_CHECKING:`` do
  not run and are left out; imports inside functions are counted: they are dependencies too).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jobs", "udfs")
DEV = "jobs.dev"
FACE = {"jobs.cli", "jobs.demo"}


@dataclass(frozen=True)
class Import:
    module: str
    target: str
    line: int
    type_checking: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an imported name refers to (``jobs.runtime.jars`` for ``from jobs import jars``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path) -> Iterator[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, type_checking: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit_stmt(stmt, True)
                for stmt in child.orelse:
                    yield from visit_stmt(stmt, type_checking)
                continue
            yield from visit_stmt(child, type_checking)

    def visit_stmt(node: ast.AST, type_checking: bool) -> Iterator[Import]:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from jobs import jars` imports the module jobs.runtime.jars; `from jobs.runtime.jars import x`, jobs.runtime.jars.
            names = [f"{base}.{alias.name}" for alias in node.names] if base else []
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                yield Import(module, target, getattr(node, "lineno", 0), type_checking)
        yield from visit(node, type_checking)

    yield from visit(ast.parse(path.read_text(), filename=str(path)), False)


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports(module, path)]


def _is_dev(module: str) -> bool:
    return module == DEV or module.startswith(DEV + ".")


def _on_the_jobs_path(module: str) -> bool:
    return not _is_dev(module) and module not in FACE


def test_the_jobs_path_imports_no_dev_tooling() -> None:
    offending = [f"{MODULES[i.module].relative_to(ROOT)}:{i.line} imports {i.target}" for i in IMPORTS
                 if _on_the_jobs_path(i.module) and _is_dev(i.target)]
    assert not offending, "the job's path imports jobs/dev/:\n" + "\n".join(offending)


def test_imports_inside_functions_are_seen() -> None:
    """The checks can fail: `jobs/cli.py` imports the model-server modules inside a function."""
    assert {("jobs.cli", "jobs.dev.real_models"), ("jobs.cli", "jobs.dev.simulator.cli")} <= {
        (i.module, i.target) for i in IMPORTS if not i.type_checking}


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if not i.type_checking:
            graph[i.module].add(i.target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
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
            connect(node)
    return found


def test_no_import_cycles_among_jobs_and_udfs() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


ENTRY_POINTS = {"jobs.cli", "jobs.demo", "jobs.inference_job"}
"""The commands and the cluster's entry script: the top of the graph, which nothing below imports."""


def _concern(module: str) -> str:
    """The package a module belongs to by concern (``udfs.inference`` for ``udfs.inference.client``);
    a module directly under ``jobs/`` or ``udfs/`` (``udfs.errors``, ``jobs.cli``) is its own."""
    parts = module.split(".")
    if parts[:2] == ["jobs", "dev"]:
        return "jobs.dev"
    return ".".join(parts[:2])


def _concern_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for i in IMPORTS:
        source, target = _concern(i.module), _concern(i.target)
        graph.setdefault(source, set())
        graph.setdefault(target, set())
        if not i.type_checking and source != target:
            graph[source].add(target)
    return graph


def test_packages_per_concern_form_layers_without_cycles() -> None:
    """Packages per concern (udfs/config, records, cost, inference, lanes; jobs/clients, runtime,
    state, graph, observe, launch): a package may lean on those below it, never on one that leans on it."""
    cycles = _cycles(_concern_graph())
    assert not cycles, "cycles between packages: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_only_the_commands_import_the_commands() -> None:
    offending = [f"{MODULES[i.module].relative_to(ROOT)}:{i.line} imports {i.target}" for i in IMPORTS
                 if i.target in ENTRY_POINTS and i.module not in ENTRY_POINTS and not _is_dev(i.module)]
    assert not offending, "an entry point imported from below:\n" + "\n".join(offending)


def test_what_flink_runs_never_imports_the_commands_side() -> None:
    """`udfs/` is shipped to the Python workers alone: it cannot lean on `jobs/`."""
    offending = [f"{MODULES[i.module].relative_to(ROOT)}:{i.line} imports {i.target}" for i in IMPORTS
                 if i.module.startswith("udfs") and i.target.startswith("jobs")]
    assert not offending, "udfs/ imports jobs/:\n" + "\n".join(offending)


def test_concern_graph_sees_the_packages() -> None:
    """The checks can fail: the lanes lean on inference, and inference on records."""
    graph = _concern_graph()
    assert "udfs.inference" in graph["udfs.lanes"] and "udfs.records" in graph["udfs.inference"]


def test_nothing_imports_the_lanes_old_paths() -> None:
    """`udfs.stage` and `udfs.provider_batch` only keep what was pickled under those names loading
    (`udfs/stage/__init__.py`); the code imports `udfs.lanes`."""
    old = ("udfs.stage", "udfs.provider_batch")
    offending = [f"{MODULES[i.module].relative_to(ROOT)}:{i.line} imports {i.target}" for i in IMPORTS
                 if i.target.startswith(old) and not i.module.startswith(old)]
    assert not offending, "\n".join(offending)


def test_no_module_of_udfs_shares_a_name_with_the_standard_library() -> None:
    """On a Flink cluster the Python workers find the shipped `udfs/` on their path as a folder, so a
    `udfs/secrets.py` would stand in for the standard library's `secrets` (numpy's random module,
    which pandas loads for the vectorized lane, imports it and failed with `cannot import name randbits`)."""
    import sys

    top = {p.stem for p in (ROOT / "udfs").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert not top & set(sys.stdlib_module_names), sorted(top & set(sys.stdlib_module_names))
