"""Test-wide hooks: the shared fixture modules, the shell's environment, the run order and how
two workers share it.

Markers, warning filters and test paths are in ``pyproject.toml``. What test modules share lives
in ``tests/support/`` (see its ``__init__``); its fixture modules are plugins, listed here because
pytest takes ``pytest_plugins`` only from the top conftest.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

# The environment as the user's shell gave it, before any test ran PyFlink in this process:
# PyFlink's in-process (loopback) workers merge their own settings into os.environ, and a
# command a test starts should see what a user's command would see.
SHELL_ENV = dict(os.environ)

# Generated inputs (Hypothesis, tests/unit/test_generated_*.py): `ci`, what `make test` runs, is
# bounded and reproducible (a fixed seed per test, no example database, no deadline: a loaded
# machine must not fail a test by its speed); `fuzz`, what `make fuzz` runs, draws many more and
# keeps the failures it finds in var/hypothesis to try first next time (docs/testing.md).
settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("fuzz", max_examples=int(os.environ.get("LLMSTREAM_FUZZ_EXAMPLES", "5000")), deadline=None,
                          database=DirectoryBasedExampleDatabase("var/hypothesis"),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("LLMSTREAM_HYPOTHESIS_PROFILE", "ci"))

pytest.register_assert_rewrite("tests.support")  # before any import of it: its asserts explain themselves

pytest_plugins = [
    "tests.support.servers",
    "tests.support.stages",
]


KEPT_WHOLE = frozenset({
    "tests/integration/test_bench.py", "tests/integration/test_command_failures.py",
    "tests/integration/test_compose.py", "tests/integration/test_containers.py",
    "tests/integration/test_kubernetes.py", "tests/integration/test_preflight.py",
    "tests/integration/test_real_models.py", "tests/integration/test_security.py",
    "tests/unit/jobs/runtime/test_jars.py", "tests/unit/udfs/inference/test_model_tls.py",
})
"""Modules whose tests share a module fixture (a compose project, a model server, the smoke bench, a
broker of their own): `make test`'s workers take each of them whole, in file order. Every other test
goes to whichever worker is free. `pytest_collection_modifyitems` refuses a module that uses a module
fixture and is missing here; the controller, which collects nothing, can only read this list."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadscope` with one scope per test, except the modules in `KEPT_WHOLE`."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TestsOrWholeModules(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if module in KEPT_WHOLE else nodeid

    return TestsOrWholeModules(config, log)


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


def _module_rank(items: list[pytest.Item]) -> int:
    """Where a module's tests go in the run, longest work first (so two workers end together):
    fault tests, then other slow integration tests, other integration tests, unit tests, then
    the container tests and the real-model tests, last, because `make test` builds the image and
    llama.cpp in the background meanwhile."""
    def has(name: str) -> bool:
        return any(item.get_closest_marker(name) is not None for item in items)

    if has("real_model"):
        return 5
    if has("containers"):
        return 4
    if items[0].nodeid.startswith("tests/unit/"):
        return 3
    return 0 if has("fault") else 1 if has("slow") else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The run order: modules kept together, ranked by `_module_rank`. `make test` runs two
    pytest-xdist workers with ``--dist loadscope --no-loadscope-reorder`` and the scheduler above:
    tests (and `KEPT_WHOLE` modules) are handed out in this order as workers free up."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    rank = {name: _module_rank(module) for name, module in by_module.items()}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])
    shared = sorted(name for name, module in by_module.items()
                    if name not in KEPT_WHOLE and any(_uses_module_fixture(item) for item in module))
    if shared:
        raise pytest.UsageError(f"{', '.join(shared)}: a module fixture, so add the module to KEPT_WHOLE in "
                                "tests/conftest.py (two workers would each make it, out of file order)")
