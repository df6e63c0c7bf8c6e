"""The tiers as the README selects them: ``-m unit`` leaves the slow tier out, as the default run does."""

from __future__ import annotations

import types

import pytest

from tests import conftest

pytestmark = pytest.mark.unit


class _Item:
    def __init__(self, name: str, *marks: str) -> None:
        self.name, self.marks = name, set(marks)

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None


def _select(markexpr: str | None) -> tuple[list[str], list[str]]:
    deselected: list = []
    config = types.SimpleNamespace(
        getoption=lambda name: markexpr if name == "markexpr" else None,
        hook=types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    items = [_Item("fast", "unit"), _Item("full_count", "unit", "slow"), _Item("spawn", "gloo")]
    conftest.pytest_collection_modifyitems(config, items)
    return [i.name for i in items], [i.name for i in deselected]


@pytest.mark.parametrize("markexpr", ["unit", "unit or gloo", "not gloo", ""])
def test_an_expression_without_slow_leaves_the_slow_tier_out(markexpr):
    kept, deselected = _select(markexpr)
    assert "full_count" not in kept and deselected == ["full_count"], (kept, deselected)


@pytest.mark.parametrize("markexpr", ["slow", "unit or slow", "unit and slow"])
def test_an_expression_naming_slow_keeps_it(markexpr):
    kept, deselected = _select(markexpr)
    assert "full_count" in kept and deselected == [], (kept, deselected)
