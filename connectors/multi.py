"""``multi:A,B,...``: vLLM's ``MultiConnector`` over the listed adapters, in order.

What 0.33 does: every child connector sees the *same* request
``kv_transfer_params`` dict. At admission the first child (in config order) that
reports loadable tokens loads the request; every child saves. When a request
finishes, the children's returned params are merged into one dict, and a key
returned by two children is an error. So a composition is only sound when the
children's keys do not collide (the ``do_remote_*`` flags aside, which mean the
same to all): ``multi:nixl,offloading`` and ``multi:nixl,example`` are; two
children that both use ``remote_engine_id`` (``nixl`` and ``mooncake``) are not, and
are refused when the adapter is built.

Contract for the executor: treat it as one adapter. Its order is ``TOGETHER`` only
when every child's is (for this context), else ``SEQUENTIAL``; its lookups and
headers are the children's together; bodies carry the merged params; the prefill
answer is read by every child and the outcomes merged (``finished`` if the answer
finished, ``stale`` if any child says so, ``learned`` from the first that learned).

Source: ``vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py``
(``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``_aggregate_request_finished``).
"""

from __future__ import annotations

from collections.abc import Sequence

from connectors._base import (
    Adapter,
    Body,
    ConnectorError,
    ConnectorInfo,
    Leg,
    LegOrder,
    Lookup,
    Params,
    PrefillOutcome,
    TransferContext,
    finished_naturally,
    merge_params,
)

__all__ = ["MultiConnector"]

_SHARED_FLAGS = frozenset({"do_remote_decode", "do_remote_prefill"})


def _check_keys(children: Sequence[Adapter]) -> None:
    infos = [c.describe() for c in children]
    for attr in ("prefill_keys", "decode_keys"):
        seen: dict[str, str] = {}
        for info in infos:
            for key in sorted(getattr(info, attr) - _SHARED_FLAGS):
                if key in seen:
                    raise ConnectorError(
                        f"multi: {seen[key]!r} and {info.name!r} both use "
                        f"kv_transfer_params key {key!r}"
                    )
                seen[key] = info.name


class MultiConnector(Adapter):
    """The composition of ``children`` (at least one; no nested ``multi``)."""

    leg_order: LegOrder

    def __init__(self, children: Sequence[Adapter]) -> None:
        if not children:
            raise ConnectorError("multi needs at least one connector")
        if any(isinstance(c, MultiConnector) for c in children):
            raise ConnectorError("multi cannot contain multi")
        names = [c.name for c in children]
        if len(set(names)) != len(names):
            raise ConnectorError(f"multi lists a connector twice: {','.join(names)}")
        _check_keys(children)
        self.children = tuple(children)
        self.name = "multi:" + ",".join(names)
        together = all(c.leg_order is LegOrder.TOGETHER for c in children)
        self.leg_order = LegOrder.TOGETHER if together else LegOrder.SEQUENTIAL

    def describe(self) -> ConnectorInfo:
        infos = tuple(c.describe() for c in self.children)
        return ConnectorInfo(
            name=self.name,
            vllm_connectors=("MultiConnector",),
            handovers=frozenset().union(*(i.handovers for i in infos)),
            leg_order=self.leg_order,
            shared_request_id=any(i.shared_request_id for i in infos),
            returns_params=any(i.returns_params for i in infos),
            peer_fields=frozenset().union(*(i.peer_fields for i in infos)),
            prefill_keys=frozenset().union(*(i.prefill_keys for i in infos)),
            decode_keys=frozenset().union(*(i.decode_keys for i in infos)),
            address_keys=frozenset().union(*(i.address_keys for i in infos)),
            children=infos,
        )

    def order(self, ctx: TransferContext | None = None) -> LegOrder:
        orders = {c.order(ctx) for c in self.children}
        return LegOrder.TOGETHER if orders == {LegOrder.TOGETHER} else LegOrder.SEQUENTIAL

    def lookups(self, ctx: TransferContext) -> tuple[Lookup, ...]:
        return tuple(lookup for c in self.children for lookup in c.lookups(ctx))

    def headers(self, leg: Leg, ctx: TransferContext) -> dict[str, str]:
        merged: dict[str, str] = {}
        for child in self.children:
            for key, value in child.headers(leg, ctx).items():
                if merged.get(key, value) != value:
                    raise ConnectorError(f"multi: children disagree on header {key!r}")
                merged[key] = value
        return merged

    def prefill_params(self, ctx: TransferContext | None) -> Params | None:
        return merge_params([c.prefill_params(ctx) for c in self.children])

    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        outcomes = [c.read_prefill(answer, ctx) for c in self.children]
        learned = next((o.learned for o in outcomes if o.learned is not None), None)
        return PrefillOutcome(
            params=merge_params([o.params for o in outcomes]),
            finished=finished_naturally(answer) and all(o.params is None for o in outcomes),
            learned=learned,
            stale=any(o.stale for o in outcomes),
        )

    def ahead_params(self, ctx: TransferContext) -> Params:
        merged = merge_params([c.ahead_params(ctx) for c in self.children])
        assert merged is not None  # each child returns a dict
        return merged
