"""Built-in pickers: tables, tie-breaking and the weighted draw's distribution."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping

import pytest

from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import PluginSpec, RoutingRequest
from pd_orchestrator.routing.interfaces import Picker
from pd_orchestrator.routing.registry import PICKER
from pd_orchestrator.routing.types import ScoredCandidate
from tests.routing.helpers import candidate, request, scored


def picker(
    type_: str,
    params: Mapping[str, object] | None = None,
    profile: str = "test",
    name: str | None = None,
) -> Picker:
    spec = PluginSpec.model_validate({"type": type_, "name": name, "params": params or {}})
    return builtin_registry().build(PICKER, spec, profile)


@pytest.mark.parametrize(
    ("totals", "req", "params", "chosen"),
    [
        ([0.2, 0.9, 0.5], request(), {}, 1),
        ([0.9, 0.2, 0.9], request(sequence=0), {}, 0),
        ([0.9, 0.2, 0.9], request(sequence=1), {}, 2),
        ([0.9, 0.2, 0.9], request(sequence=2), {}, 0),
        ([0.85, 0.9, 0.2], request(sequence=0), {"tolerance": 0.1}, 0),
        ([0.85, 0.9, 0.2], request(sequence=1), {"tolerance": 0.1}, 1),
        ([0.85, 0.9, 0.2], request(sequence=1), {}, 1),
        ([0.0], request(), {}, 0),
    ],
    ids=[
        "highest",
        "tie-rotation-0",
        "tie-rotation-1",
        "tie-rotation-wraps",
        "tolerance-0",
        "tolerance-1",
        "strict-without-tolerance",
        "single",
    ],
)
def test_max_score(
    totals: list[float], req: RoutingRequest, params: dict[str, float], chosen: int
) -> None:
    assert picker("max-score", params).pick(req, scored(*totals)) == chosen


def test_max_score_rotation_shares_equal_endpoints() -> None:
    plugin = picker("max-score")
    picks = Counter(plugin.pick(request(sequence=s), scored(1, 1, 1, 0)) for s in range(30))
    assert picks == {0: 10, 1: 10, 2: 10}


def test_max_score_affinity_key_is_sticky_and_spreads() -> None:
    plugin = picker("max-score")
    candidates = scored(1, 1, 1, 1)
    for key in ("alpha", "beta", "gamma"):
        picks = {plugin.pick(request(affinity_key=key, sequence=s), candidates) for s in range(5)}
        assert len(picks) == 1
    spread = {plugin.pick(request(affinity_key=f"k{k}"), candidates) for k in range(40)}
    assert spread == {0, 1, 2, 3}


def test_max_score_affinity_is_the_rendezvous_hash_of_key_and_name() -> None:
    """The tie goes to the endpoint whose name hashes highest with the key (blake2b,
    8 bytes, of ``key NUL name``): a key keeps its endpoint from one version to the next,
    long keys and names outside ASCII included."""
    plugin = picker("max-score")
    candidates = scored(1, 1, 1, 1, 1, 1)
    names = [c.endpoint.name for c in candidates]

    def expected(key: str) -> int:
        def hashed(name: str) -> int:
            digest = hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()
            return int.from_bytes(digest, "big")

        return max(range(len(names)), key=lambda i: hashed(names[i]))

    keys = ["alpha", "user:" + "x" * 4000, "système: ünïcode ✓", "", *(f"k{k}" for k in range(30))]
    picks = [plugin.pick(request(affinity_key=key), candidates) for key in keys]
    assert picks == [expected(key) for key in keys]
    assert len(set(picks)) > 2  # the keys spread


def _loaded(*in_flight: int) -> list[ScoredCandidate]:
    return [ScoredCandidate(candidate(f"e{i}", in_flight=n), 1.0) for i, n in enumerate(in_flight)]


def test_max_score_load_bound_keeps_a_key_until_its_endpoint_is_crowded() -> None:
    free = picker("max-score", {"tolerance": 1.0})
    bounded = picker("max-score", {"tolerance": 1.0, "load_bound": 1.25})
    keys = [f"k{k}" for k in range(40)]
    home = {key: free.pick(request(affinity_key=key), _loaded(0, 0, 0, 0)) for key in keys}
    for key in keys:  # nothing crowded: the same endpoint as plain affinity
        assert bounded.pick(request(affinity_key=key), _loaded(2, 2, 2, 2)) == home[key]
    # endpoint 0 holds 12 of 16 queued requests: mean 4, bound 1.25 * 4 + 1 = 6
    crowded = _loaded(12, 2, 1, 1)
    for key in keys:
        chosen = bounded.pick(request(affinity_key=key), crowded)
        assert chosen == home[key] if home[key] != 0 else chosen != 0
        assert free.pick(request(affinity_key=key), crowded) == home[key]
    # the overflow goes where the key hashes next, not always to the shallowest
    overflow = {bounded.pick(request(affinity_key=k), crowded) for k in keys if home[k] == 0}
    assert len(overflow) > 1


def test_max_score_load_bound_takes_the_first_within_the_bound_in_rendezvous_order() -> None:
    """Past the bound a key goes down its own rendezvous order (the hash of ``key NUL
    name``, highest first) to the first endpoint within the bound: exactly that one."""
    bounded = picker("max-score", {"tolerance": 1.0, "load_bound": 1.0})
    crowded = _loaded(9, 0, 7, 1, 8, 0)  # mean 25/6: the bound 1.0 * 25/6 + 1 (5.17)
    names = [s.endpoint.name for s in crowded]
    depths = [9, 0, 7, 1, 8, 0]

    def expected(key: str) -> int:
        def hashed(i: int) -> int:
            data = f"{key}\x00{names[i]}".encode()
            return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")

        order = sorted(range(len(names)), key=hashed, reverse=True)
        return next(i for i in order if depths[i] <= 25 / 6 + 1)

    keys = [f"k{k}" for k in range(60)]
    picks = [bounded.pick(request(affinity_key=key), crowded) for key in keys]
    assert picks == [expected(key) for key in keys]
    assert set(picks) == {1, 3, 5}  # every endpoint within the bound takes some key


def test_max_score_load_bound_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="load_bound"):
        picker("max-score", {"load_bound": 0.5})


def test_max_score_affinity_yields_to_a_better_total() -> None:
    plugin = picker("max-score")
    for k in range(20):
        assert plugin.pick(request(affinity_key=f"k{k}"), scored(0.5, 0.9, 0.5)) == 1


@pytest.mark.parametrize(
    ("totals", "allowed"),
    [([0.0, 1.0, 0.0], {1}), ([2.0, 0.0, 3.0], {0, 2}), ([0.0, 0.0], {0, 1}), ([1.0], {0})],
    ids=["only-positive", "zero-never-drawn", "all-zero-uniform", "single"],
)
def test_weighted_random_draws_allowed_candidates(totals: list[float], allowed: set[int]) -> None:
    plugin = picker("weighted-random", {"seed": 3})
    picks = {plugin.pick(request(sequence=s), scored(*totals)) for s in range(200)}
    assert picks == allowed


def test_weighted_random_is_proportional_to_totals() -> None:
    plugin = picker("weighted-random", {"seed": 11})
    draws = 4000
    picks = Counter(plugin.pick(request(sequence=s), scored(1, 3, 0, 4)) for s in range(draws))
    assert picks[2] == 0
    for index, share in ((0, 1 / 8), (1, 3 / 8), (3, 4 / 8)):
        assert abs(picks[index] / draws - share) < 0.03


def test_weighted_random_uniform_when_all_zero() -> None:
    plugin = picker("weighted-random")
    picks = Counter(plugin.pick(request(sequence=s), scored(0, 0, 0, 0)) for s in range(2000))
    assert all(abs(n / 2000 - 0.25) < 0.04 for n in picks.values()) and len(picks) == 4


def test_weighted_random_is_deterministic_per_seed_and_instance() -> None:
    totals = scored(1, 1, 1, 1, 1)

    def draws(plugin: Picker) -> list[int]:
        return [plugin.pick(request(sequence=s), totals) for s in range(50)]

    first = draws(picker("weighted-random", {"seed": 7}))
    assert draws(picker("weighted-random", {"seed": 7})) == first
    assert draws(picker("weighted-random", {"seed": 8})) != first
    assert draws(picker("weighted-random", {"seed": 7}, profile="prefill")) != first
    assert draws(picker("weighted-random", {"seed": 7}, name="other")) != first


def test_max_score_rotate_ignores_the_affinity_key() -> None:
    from pd_orchestrator.routing.pickers import MaxScorePicker

    picker = MaxScorePicker(1e-9, "rotate")
    totals = scored(1.0, 1.0, 1.0)
    picks = {picker.pick(request(affinity_key="same", sequence=s), totals) for s in range(3)}
    assert picks == {0, 1, 2}
    affine = MaxScorePicker(1e-9, "affinity")
    assert (
        len({affine.pick(request(affinity_key="same", sequence=s), totals) for s in range(3)}) == 1
    )
