"""Inference stages on the fake PyFlink runtime (``tests/support/fake_flink.py``): the ``harnesses``
fixture, a plugin listed in ``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the fixture only holds them: PyFlink is not imported for every test session
    from tests.support.fake_flink import Harness


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    """Append each `Harness` a test makes; all are closed after the test."""
    made: list[Harness] = []
    yield made
    for h in made:
        h.close()
