"""The pending blocks: what prompts in flight on an endpoint hold, counted."""

from __future__ import annotations

from pd_orchestrator.prefix.pending import PendingBlocks


def test_leading_counts_the_keys_held_in_a_row() -> None:
    pending: PendingBlocks[int] = PendingBlocks()
    pending.hold("d0", [1, 2, 3])
    assert pending.leading([1, 2, 3, 4], "d0") == 3
    assert pending.leading([1, 9, 3], "d0") == 1  # a row: the third does not count
    assert pending.leading([9, 1, 2], "d0") == 0
    assert pending.leading([1, 2], "d1") == 0  # another endpoint holds none
    assert pending.leading([], "d0") == 0


def test_a_key_stays_pending_while_any_prompt_holds_it() -> None:
    """Two prompts share a prefix: giving one back keeps the other's keys."""
    pending: PendingBlocks[int] = PendingBlocks()
    pending.hold("d0", [1, 2, 3])
    pending.hold("d0", [1, 2, 7])
    pending.release("d0", [1, 2, 3])
    assert pending.leading([1, 2, 3], "d0") == 2
    assert pending.leading([1, 2, 7], "d0") == 3
    pending.release("d0", [1, 2, 7])
    assert pending.leading([1, 2, 7], "d0") == 0
    assert pending.keys("d0") == 0


def test_releasing_what_no_prompt_holds_changes_nothing() -> None:
    pending: PendingBlocks[bytes] = PendingBlocks()
    pending.release("d0", [b"a"])  # an endpoint that holds nothing
    pending.hold("d0", [b"a", b"b"])
    pending.release("d0", [b"c"])  # a key it does not hold
    assert pending.leading([b"a", b"b"], "d0") == 2
    assert pending.keys("d0") == 2
