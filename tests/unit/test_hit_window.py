"""The hit rate's window reaches back until it holds enough queried tokens."""

from __future__ import annotations

from pd_orchestrator.model.hit_window import HIT_WINDOW_STARTS, HitWindow


def _held(window: HitWindow[str]) -> list[str]:
    return [reading for _, reading in window.starts]


def test_the_window_starts_at_the_newest_reading_with_enough_tokens_since() -> None:
    window: HitWindow[str] = HitWindow(1_000)
    assert window.start(0) is None  # nothing held yet
    for queries, name in ((0, "r0"), (600, "r1"), (900, "r2"), (1_300, "r3")):
        window.moved(queries, name)
    assert window.start(1_300) is None  # nothing queried since the newest
    assert window.start(1_950) == "r2"  # 650 since r3, 1,050 since r2
    assert window.start(1_600) == "r1"  # 700 since r2, 1,000 since r1
    assert window.start(1_350) == "r0"  # only r0's 1,350
    assert HitWindow[str](10**6, window.starts).start(1_350) == "r0"  # none: the oldest
    assert HitWindow[str](0, window.starts).start(1_400) == "r3"  # 0: the newest


def test_only_a_moved_counter_makes_a_start_and_a_restart_forgets_the_rest() -> None:
    window: HitWindow[str] = HitWindow(1_000)
    for queries, name in ((0, "r0"), (0, "idle"), (500, "r1"), (500, "idle")):
        window.moved(queries, name)
    assert _held(window) == ["r0", "r1"]  # idle polls move nothing
    window.moved(200, "restarted")  # the counter went back: the server restarted
    assert _held(window) == ["restarted"]
    assert window.start(100) is None  # below the count held: restarted since
    window.moved(250, "r2")
    assert window.start(300) == "restarted"  # a restart forgot the counts before it
    window.restart(700, "rebase")
    assert _held(window) == ["rebase"] and window.start(750) == "rebase"


def test_the_window_holds_the_last_starts_only() -> None:
    window: HitWindow[str] = HitWindow(10**9)
    for n in range(HIT_WINDOW_STARTS + 5):
        window.moved(n * 10, f"r{n}")
    assert len(window.starts) == HIT_WINDOW_STARTS
    assert window.start(10**6) == "r5"  # the oldest held
