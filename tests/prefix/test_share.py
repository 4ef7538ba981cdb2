"""The share guard: fair share plus slack over a window of recent decisions."""

from __future__ import annotations

import pytest

from pd_orchestrator.prefix.affinity import AffinityParams, PrefixTree, affinity_choice
from pd_orchestrator.prefix.share import ShareGuard


def guard_after(decisions: str, slack: float | None = 0.1, window: int = 20) -> ShareGuard:
    guard = ShareGuard(slack, window)
    for name in decisions:
        guard.record(name)
    return guard


@pytest.mark.parametrize(
    ("decisions", "slack", "expected"),
    [
        ("ab" * 10, 0.1, [False, False]),
        ("a" * 14 + "b" * 6, 0.1, [True, False]),
        ("a" * 12 + "b" * 8, 0.1, [False, False]),
        ("a" * 7, 0.1, [False, False]),
        ("a" * 20, None, [False, False]),
    ],
    ids=["balanced", "over", "within-slack", "too-few-decisions", "off"],
)
def test_over(decisions: str, slack: float | None, expected: list[bool]) -> None:
    assert guard_after(decisions, slack).over(["a", "b"]) == expected


def test_the_window_forgets_old_decisions() -> None:
    guard = guard_after("a" * 20 + "b" * 20)
    assert guard.share("a") == 0.0 and guard.share("b") == 1.0
    assert guard.over(["a", "b"]) == [False, True]


def test_a_blocked_holder_loses_its_prefix_preference() -> None:
    tree = PrefixTree()
    tree.insert("shared system prompt, then a question", "a", 0.0)
    params = AffinityParams()
    text = "shared system prompt, then another question"
    assert affinity_choice(tree, text, ["a", "b"], [0, 0], params) == 0
    chosen = affinity_choice(tree, text, ["a", "b"], [0, 0], params, blocked=[True, False])
    assert chosen == 1
