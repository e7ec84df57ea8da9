"""How the tests are laid out, read from their source (AST): no module under ``tests/`` imports a
test module (``test_*.py``), and what tests share lives in ``tests/support/`` and nowhere else.

A helper that two test modules need lives in ``tests/support/`` (fixtures in its plugin modules),
so running one test module never drags in another's tests, and pytest imports each test module
once, under one name (a test module imported from elsewhere is a second copy under another name).
Imports are counted wherever they are, inside functions too.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every module an import statement names; ``from a import b`` names
    ``a`` and ``a.b`` (b may be a module), relative names keep their leading dots."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if node.module:
                yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}{alias.name}" if base.endswith(".") else f"{base}.{alias.name}"


def _is_test_module(name: str, test_modules: set[str]) -> bool:
    """Whether an imported name is one of our test modules: as ``tests.<dir>.test_x``, relative
    (``.test_x``), or bare (``test_x``, importable when pytest puts a test directory on sys.path)."""
    parts = name.lstrip(".").split(".")
    if parts[-1] not in test_modules:
        return False
    return name.startswith(".") or parts[0] == "tests" or len(parts) == 1


def _violations() -> dict[str, list[str]]:
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")}
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imports(tree):
            if _is_test_module(name, test_modules):
                found.setdefault(path.relative_to(ROOT).as_posix(), []).append(f"line {line}: {name}")
    return found


def test_no_module_under_tests_imports_a_test_module() -> None:
    violations = _violations()
    assert not violations, (
        "test modules import other test modules (move what they share to tests/support/):\n"
        + "\n".join(f"  {path}: {', '.join(lines)}" for path, lines in violations.items()))


def test_the_check_sees_each_form_of_import() -> None:
    source = textwrap.dedent("""\
        from tests.unit.test_client import job_config
        from tests.unit import test_client
        import tests.integration.test_faults
        from .test_observe import wait_for
        from . import test_observe
        import test_cache
        def f():
            from tests.integration.test_faults import start_run
        from tests.support.waiting import wait_until
        from tests.support.job_setup import make_job
        import unittest
        from jobs.dev import simulator
    """)
    modules = {"test_client", "test_faults", "test_observe", "test_cache"}
    flagged = sorted({line for line, name in _imports(ast.parse(source)) if _is_test_module(name, modules)})
    assert flagged == [1, 2, 3, 4, 5, 6, 8]


EXPERIMENTS = TESTS / "experiments"
"""Scripts run by hand (``python -m tests.experiments.<name>``), not support: no test imports them."""


def _misplaced_support(paths: list[Path]) -> list[str]:
    """Modules under ``tests/`` that are neither a test module, a conftest, a package's
    ``__init__``, an experiment nor in ``tests/support/``: support living somewhere else."""
    support = TESTS / "support"
    return [path.relative_to(ROOT).as_posix() for path in paths
            if not (path.name.startswith("test_") or path.name in ("conftest.py", "__init__.py")
                    or path.is_relative_to(support) or path.is_relative_to(EXPERIMENTS))]


def test_shared_support_lives_only_in_tests_support() -> None:
    misplaced = _misplaced_support(sorted(TESTS.rglob("*.py")))
    assert not misplaced, f"support outside tests/support/ (move it there): {misplaced}"


def test_the_support_check_flags_a_helper_beside_the_tests() -> None:
    paths = [TESTS / "unit" / "fake_flink.py", TESTS / "integration" / "helpers.py", TESTS / "redis_server.py",
             TESTS / "support" / "waiting.py", TESTS / "unit" / "test_cache.py", TESTS / "conftest.py",
             TESTS / "integration" / "conftest.py", TESTS / "__init__.py", EXPERIMENTS / "budget_hour.py"]
    assert _misplaced_support(paths) == ["tests/unit/fake_flink.py", "tests/integration/helpers.py",
                                         "tests/redis_server.py"]


def test_no_two_test_modules_share_a_file_name() -> None:
    """tests/unit and tests/integration are not packages, so pytest imports each test module by its
    bare name: two `test_x.py` in different folders stop the collection of `pytest tests` (make test)
    with "import file mismatch" although each folder alone collects fine."""
    seen: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a name: {clashes}"
