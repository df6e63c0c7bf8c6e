"""The tiers as the README selects them: ``-m unit`` leaves the slow tier out, as the default run does."""

from __future__ import annotations

import pathlib
import types

import pytest

from tests import conftest

pytestmark = pytest.mark.unit


class _Item:
    def __init__(self, name: str, *marks: str, file: str = "test_x.py") -> None:
        self.name, self.marks, self.path = name, set(marks), pathlib.Path("tests", file)

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


def test_the_longest_files_go_first_each_in_its_own_order():
    """Under xdist's loadfile each worker takes the next file: conftest.LONGEST_FIRST's files go out first, in
    its order, then the others most tests first; a file's tests keep their order, and none is left out."""
    config = types.SimpleNamespace(getoption=lambda name: None, hook=types.SimpleNamespace(pytest_deselected=None))
    longest, second = conftest.LONGEST_FIRST[:2]
    items = [_Item("a1", file="test_a.py"), _Item("b1", file="test_b.py"), _Item("b2", file="test_b.py"),
             _Item("s1", file=second), _Item("l1", file=longest), _Item("s2", file=second), _Item("l2", file=longest)]
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == ["l1", "l2", "s1", "s2", "b1", "b2", "a1"]
