"""``pd-orchestrator profile``: the fit recovers a known model, the command measures
a simulated pair on loopback to within a tolerance of the profile it runs, and the
file it writes runs a simulator and names a pool's knowledge."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import httpx
import pytest

from pd_orchestrator.bench.profiling import ProfileOptions, cache_capacity
from pd_orchestrator.cli.main import main
from pd_orchestrator.config.loader import parse_config
from pd_orchestrator.fleet.endpoints import endpoints_from_config
from pd_orchestrator.model.hardware import PROFILES, LatencyProfile
from pd_orchestrator.model.measured import (
    Measured,
    MixedPoint,
    Points,
    PrefillPoint,
    StepPoint,
    TransferPoint,
    dump_measured,
    fit,
    load_measured,
    resolve_profile,
)
from pd_orchestrator.policies.goodput_model import knowledge_of
from tests.conftest import SimFactory

H200 = PROFILES["h200-llama3-8b"]


def _slow(factor: float, link_factor: float) -> LatencyProfile:
    """The H200 profile ``factor`` times slower (its link ``link_factor`` times): long
    enough steps that a busy machine's overheads stay small beside them."""
    return dataclasses.replace(
        H200.on_clock(factor),
        name="slow",
        model="sim-model",
        link_bytes_per_s=H200.link_bytes_per_s / link_factor,
    )


def _synthetic(p: LatencyProfile) -> Points:
    """Exact points of ``p``, as the profiler would measure them on a quiet machine."""
    prefill = [
        PrefillPoint(n, c, p.a_pf + p.prefill_seconds(n, c))
        for n, c in ((512, 0), (2048, 0), (4096, 0), (1024, 1024), (400, 3696))
    ]
    decode = [
        StepPoint(b, b * c, p.step_seconds(b * c, b)) for b in (1, 4, 16) for c in (256, 2048)
    ]
    mixed = [MixedPoint(16, 16 * 300, 2048, p.step_seconds(16 * 300, 16, [(2048, 0)]))]
    handover = [TransferPoint(n, p.transfer_seconds(n)) for n in (512, 2048, 4096)]
    return Points(tuple(prefill), tuple(decode), tuple(mixed), tuple(handover))


def test_the_fit_recovers_the_model_its_points_came_from() -> None:
    fitted = fit(_synthetic(H200), name="h", model=H200.model)
    for name in ("a_pf", "a_dec", "lin", "attn", "weights", "ctx_read", "a_kv"):
        assert getattr(fitted, name) == pytest.approx(getattr(H200, name), rel=1e-6), name
    assert fitted.transfer_seconds(4096) == pytest.approx(H200.transfer_seconds(4096))


def test_a_slow_sample_among_three_does_not_move_the_fit() -> None:
    points = _synthetic(H200)
    slow = PrefillPoint(2048, 0, 10.0)  # one sample stalled by something else
    noisy = dataclasses.replace(points, prefill=points.prefill * 3 + (slow,))
    fitted = fit(noisy, name="h", model=H200.model)
    assert fitted.lin == pytest.approx(H200.lin, rel=1e-6)


def test_the_file_round_trips_and_names_what_it_is(tmp_path: Path) -> None:
    profile = fit(_synthetic(H200), name="measured-h200", model=H200.model)
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"p{suffix}"
        dump_measured(Measured(profile, _synthetic(H200), {"url": "http://x"}), path)
        loaded = load_measured(path)
        assert loaded.profile == profile and loaded.points == _synthetic(H200)
        assert resolve_profile(str(path)) == profile
    free = fit(dataclasses.replace(_synthetic(H200), handover=()), name="f", model="m")
    dump_measured(Measured(free, Points()), tmp_path / "free.json")
    assert math.isinf(load_measured(tmp_path / "free.json").profile.link_bytes_per_s)
    (tmp_path / "bad.yaml").write_text("fitted: {}\n")
    with pytest.raises(ValueError, match="not a profile file"):
        load_measured(tmp_path / "bad.yaml")
    with pytest.raises(KeyError, match="or a profile file"):
        resolve_profile(str(tmp_path / "missing.yaml"))


def _pool_config(profile: str | None, hardware: str = "h200") -> dict[str, object]:
    pool: dict[str, object] = {"name": "d", "role": "both", "hardware": hardware}
    pool["model"] = H200.model  # the simulator's table has this hardware and model
    if profile is not None:
        pool["profile"] = profile
    pool["endpoints"] = [{"name": "d0", "url": "http://127.0.0.1:1"}]
    return {"pools": [pool], "threshold": {"policy": {"type": "goodput"}}}


def test_a_pool_s_profile_file_is_its_knowledge_and_a_bare_hardware_label_is_none(
    tmp_path: Path,
) -> None:
    path = tmp_path / "measured.yaml"
    dump_measured(Measured(_slow(2.0, 1.0), Points()), path)
    (measured,) = endpoints_from_config(parse_config(_pool_config(str(path))))
    assert knowledge_of(measured) == f"measured profile {path}"
    assert measured.knowledge is not None and measured.knowledge.profile.lin == 2 * H200.lin
    (named,) = endpoints_from_config(parse_config(_pool_config("h200-llama3-8b")))
    assert knowledge_of(named) == "simulator profile h200-llama3-8b"
    (bare,) = endpoints_from_config(parse_config(_pool_config(None)))
    assert knowledge_of(bare) == "seeds"  # `hardware: h200` picks no simulator constants
    with pytest.raises(ValueError, match="or a profile file"):
        parse_config(_pool_config(str(tmp_path / "missing.yaml")))


def _within(fitted: float, true: float, rel: float) -> bool:
    return abs(fitted - true) <= rel * true


def test_profile_measures_a_simulated_pair_and_the_simulator_runs_from_what_it_wrote(
    tmp_path: Path, sim_factory: SimFactory
) -> None:
    """The simulator runs a known profile, 4x slower than the H200's (its link 10x), so
    that a busy machine's overheads stay small beside its steps; the command's fit
    predicts that profile's prefill, decode step and hand-over within a tolerance,
    and a simulator starts from the file it wrote."""
    true = _slow(4.0, 10.0)
    source = tmp_path / "true.yaml"
    dump_measured(Measured(true, Points()), source)
    sim = ("--profile", str(source), "--kv-connector", "nixl")
    decoder, prefiller = sim_factory(*sim, name="decoder"), sim_factory(*sim, name="prefiller")
    out = tmp_path / "measured.yaml"
    argv = ["profile", "--url", decoder.url, "--prefiller-url", prefiller.url, "--out", str(out)]
    bounds = ["--lengths", "512,1024,2048", "--shares", "0.5", "--batches", "1,4"]
    bounds += ["--contexts", "256,1024", "--output-tokens", "12", "--mixed-chunk", "1024"]
    bounds += ["--repeats", "2", "--max-requests", "120", "--max-seconds", "240", "--no-progress"]
    assert main(argv + bounds) == 0
    measured = load_measured(out)
    fitted, points = measured.profile, measured.points
    assert measured.source["model"] == "sim-model" and measured.source["reports_cached_tokens"]
    assert points.prefill and points.decode and points.mixed and points.handover
    assert measured.source["requests"] <= 120
    # every phase takes --repeats samples a setting; the hand-over's warm-up is no point
    assert len(points.decode) == 2 * 2 * 2 and len(points.handover) == 3 * 2
    for new, cached in ((1024, 0), (2048, 0), (1024, 1024)):
        want = true.a_pf + true.prefill_seconds(new, cached)
        got = fitted.a_pf + fitted.prefill_seconds(new, cached)
        assert _within(got, want, 0.25), (new, cached, got, want)
    for batch, context in ((1, 300), (4, 4 * 1000)):
        want, got = true.step_seconds(context, batch), fitted.step_seconds(context, batch)
        assert _within(got, want, 0.35), (batch, got, want)
    per_token = fitted.transfer_seconds(1) - fitted.a_kv
    assert _within(per_token, true.transfer_seconds(1) - true.a_kv, 0.5), per_token
    # the measured fixed cost is the simulated one plus the pull's real round trips
    assert true.a_kv * 0.5 <= fitted.a_kv <= true.a_kv + 0.2
    replay = sim_factory("--profile", str(out), name="replay")
    models = httpx.get(f"{replay.url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["sim-model"]


def test_a_short_server_gets_prompts_it_can_take_and_the_capacity_is_read_from_metrics() -> None:
    options = ProfileOptions(url="http://x", output_tokens=24).within(2048)  # the CPU pair's
    assert max(options.lengths + options.contexts) <= 2048 - 96 and options.lengths
    assert options.mixed_chunk <= 2048 - 96
    assert ProfileOptions(url="http://x").within(None) == ProfileOptions(url="http://x")
    line = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",x="y"} 1.0'
    assert cache_capacity(f"# HELP ...\n{line}\n") == 16_000
    assert cache_capacity("vllm:num_requests_running 0\n") is None


def test_the_plan_counts_repeats_in_every_phase() -> None:
    """``repeats`` samples each decode setting as it does every other phase's."""
    options = ProfileOptions(url="http://x", lengths=(256,), shares=(0.5,), batches=(1, 4),
                             contexts=(128,), repeats=3, max_requests=1000)  # fmt: skip
    cold, cached, decode, mixed = 3, 3 * 2, (1 + 4) * 3, (4 + 1) * 3
    assert options.planned() == cold + cached + decode + mixed
    handover = 3 * 3
    with_prefiller = dataclasses.replace(options, prefiller_url="http://y")
    assert with_prefiller.planned() == cold + cached + decode + mixed + handover


def test_a_hand_over_the_pair_fails_is_skipped_and_counted(
    tmp_path: Path, sim_factory: SimFactory
) -> None:
    """A prefiller that answers half its requests with 500: the profile still completes,
    with the hand-overs that worked, and counts those that did not (the warm-up's
    included)."""
    decoder = sim_factory("--profile", "instant", "--kv-connector", "nixl", name="decoder")
    prefiller = sim_factory(
        "--profile", "instant", "--kv-connector", "nixl",
        "--failure-rate", "0.5", "--fault-seed", "3", name="prefiller",
    )  # fmt: skip
    out = tmp_path / "measured.json"
    argv = ["profile", "--url", decoder.url, "--prefiller-url", prefiller.url, "--out", str(out)]
    bounds = ["--lengths", "256", "--shares", "", "--batches", "1", "--contexts", "128"]
    bounds += ["--output-tokens", "4", "--mixed-chunk", "128", "--repeats", "6", "--no-progress"]
    assert main(argv + bounds) == 0
    measured = load_measured(out)
    failed = measured.source["failed_handovers"]
    assert failed >= 1 and measured.points.handover
    assert len(measured.points.handover) + failed == 6 + 1
