"""The bench's plain spill rule, table-tested."""

from __future__ import annotations

import pytest

from pd_orchestrator.bench.spill import CROWDED_KV_USAGE, SpillLoad, plain_spill

IDLE = SpillLoad("d")
QUEUED = SpillLoad("d", waiting=3)
CROWDED = SpillLoad("d", kv_usage=CROWDED_KV_USAGE)


@pytest.mark.parametrize(
    ("decoder", "spills", "picked"),
    [
        (IDLE, [SpillLoad("p0"), SpillLoad("p1")], None),  # a calm decoder keeps it
        (SpillLoad("d", kv_usage=0.89), [SpillLoad("p0")], None),
        (QUEUED, [], None),  # nowhere to spill
        (QUEUED, [SpillLoad("p0", active_tokens=500), SpillLoad("p1")], ("p1", "queued")),
        (CROWDED, [SpillLoad("p0", active_tokens=500), SpillLoad("p1")], ("p1", "crowded")),
        # ties on the tokens: the fewest in flight, then the first
        (QUEUED, [SpillLoad("p0", in_flight=4), SpillLoad("p1", in_flight=2)], ("p1", "queued")),
        (QUEUED, [SpillLoad("p0"), SpillLoad("p1")], ("p0", "queued")),
        # a strained spilling prefiller takes none
        (
            QUEUED,
            [SpillLoad("p0", waiting=1), SpillLoad("p1", active_tokens=9000)],
            ("p1", "queued"),
        ),
        (QUEUED, [SpillLoad("p0", waiting=1), SpillLoad("p1", kv_usage=0.95)], None),
    ],
)
def test_plain_spill(
    decoder: SpillLoad, spills: list[SpillLoad], picked: tuple[str, str] | None
) -> None:
    assert plain_spill(decoder, spills) == picked
