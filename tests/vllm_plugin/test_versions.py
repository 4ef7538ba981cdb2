"""The supported vLLM releases, their hooks, and the source-marker check they rely on."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd_orchestrator.vllm_plugin._contract import check_markers, resolve
from pd_orchestrator.vllm_plugin.policy import PluginContractError, UnsupportedVLLMVersionError
from pd_orchestrator.vllm_plugin.versions import (
    HOOKS,
    SUPPORTED_VLLM_VERSIONS,
    SourceMarkers,
    check_vllm_version,
    hook_for,
    release_of,
)

# --- version check ------------------------------------------------------------------


def test_the_supported_releases_are_0_32_and_0_33() -> None:
    assert SUPPORTED_VLLM_VERSIONS == ("0.32.0", "0.33.0")


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("0.32.0", "0.32.0"),
        ("0.32.0+cpu", "0.32.0"),
        ("v0.32.0", "0.32.0"),
        (" 0.32.0+cu129 ", "0.32.0"),
        ("0.33.0", "0.33.0"),
        ("0.33.0+cpu", "0.33.0"),
        ("0.33.0+rocm711", "0.33.0"),
    ],
)
def test_builds_of_a_supported_release_get_its_hook(version: str, release: str) -> None:
    assert check_vllm_version(version) == release
    assert hook_for(version) is HOOKS[release]


@pytest.mark.parametrize(
    "version",
    ["0.32.1", "0.33.1", "0.34.0", "0.31.2", "0.33.0rc1", "0.33.0.dev3+g1234", "0.33", ""],
)
def test_other_versions_are_refused_naming_the_supported_ones(version: str) -> None:
    with pytest.raises(UnsupportedVLLMVersionError, match=r"supports vLLM 0\.32\.0, 0\.33\.0 "):
        hook_for(version)


def test_release_of_drops_prefix_blanks_and_local_label() -> None:
    assert release_of(" v0.33.0+cpu ") == "0.33.0"


# --- what differs between the hooks -----------------------------------------------


def test_each_hook_names_what_its_release_hands_the_admission_check() -> None:
    assert HOOKS["0.32.0"].hit_argument == "num_computed_tokens"
    assert HOOKS["0.33.0"].hit_argument == "ec_computed_tokens"
    for hook in HOOKS.values():
        (schedule,) = [s for s in hook.scheduler if s.qualname == "Scheduler.schedule"]
        call = f"if self._ec_transfer_pending(request, {hook.hit_argument}):"
        assert call in schedule.markers
        # The check sits before the waiting request's allocation.
        allocate = schedule.markers.index("self.kv_cache_manager.allocate_slots(")
        assert schedule.markers.index(call) < allocate


def test_only_0_32_needs_the_stream_patch() -> None:
    assert not HOOKS["0.32.0"].native_empty_finish_chunk
    assert HOOKS["0.32.0"].stream_guards == ()
    hook = HOOKS["0.33.0"]
    assert hook.native_empty_finish_chunk
    assert {s.qualname for s in hook.stream_guards} == {
        "OpenAIServingCompletion.completion_stream_generator",
        "OpenAIServingChat.chat_completion_stream_generator_raw",
        "ChatStreamProcessor.step",
    }


# --- the marker check, on real source files ------------------------------------------

_MODULE = "pdo_contract_probe"


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[str]:
    """An importable module whose ``Engine.step`` has three statements in order."""
    source = """
        class Engine:
            def step(self, request):
                hit = self.lookup(request)
                if self.pending(request, hit):
                    return None
                return self.allocate(request)
    """
    (tmp_path / f"{_MODULE}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(tmp_path))
    try:
        yield _MODULE
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(_MODULE, None)


def _markers(module: str, *markers: str) -> SourceMarkers:
    return SourceMarkers(module, "Engine.step", markers)


def test_markers_in_order_pass(probe: str) -> None:
    spec = _markers(probe, "self.lookup(request)", "self.pending(request, hit)", "allocate(")
    check_markers(spec, HOOKS["0.33.0"])


def test_markers_out_of_order_fail_naming_marker_and_release(probe: str) -> None:
    spec = _markers(probe, "self.pending(request, hit)", "self.lookup(request)")
    with pytest.raises(PluginContractError, match=r"'self\.lookup\(request\)'.*vLLM 0\.33\.0"):
        check_markers(spec, HOOKS["0.33.0"])


def test_a_missing_marker_fails(probe: str) -> None:
    spec = _markers(probe, "self.lookup(request)", "self.pending(request, ec_hit)")
    with pytest.raises(PluginContractError, match="no longer contains"):
        check_markers(spec, HOOKS["0.32.0"])


def test_a_missing_function_fails(probe: str) -> None:
    with pytest.raises(PluginContractError, match=r"has no pdo_contract_probe\.Engine\.run"):
        resolve(probe, "Engine.run")
