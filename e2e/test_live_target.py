"""How the live target is named from the environment (no server needed)."""

from __future__ import annotations

import pytest
from targets import live_target

_NAMES = ("DECODE_URLS", "PREFILL_URLS", "MODEL", "REFERENCE_URL", "CONNECTOR", "PREEMPTION")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*_NAMES, "BLOCK_SIZE"):
        monkeypatch.delenv(f"PDO_E2E_LIVE_{name}", raising=False)
        monkeypatch.delenv(f"PDO_E2E_{name}", raising=False)


def test_nothing_named_is_no_target() -> None:
    assert live_target() is None


def test_the_live_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDO_E2E_LIVE_DECODE_URLS", "http://d0:8000, http://d1:8000")
    monkeypatch.setenv("PDO_E2E_LIVE_PREFILL_URLS", "http://p0:8000")
    monkeypatch.setenv("PDO_E2E_LIVE_MODEL", "meta-llama/Llama-3.1-8B-Instruct")
    monkeypatch.setenv("PDO_E2E_LIVE_PREEMPTION", "1")
    monkeypatch.setenv("PDO_E2E_LIVE_BLOCK_SIZE", "64")
    target = live_target()
    assert target is not None
    assert target.decoders == ("http://d0:8000", "http://d1:8000")
    assert target.prefillers == ("http://p0:8000",)
    assert target.reference == "http://p0:8000"
    assert (target.connector, target.preemption, target.block_size) == ("nixl", True, 64)


def test_the_earlier_names_still_work_and_live_ones_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDO_E2E_DECODE_URLS", "http://old-d:8000")
    monkeypatch.setenv("PDO_E2E_PREFILL_URLS", "http://old-p:8000")
    monkeypatch.setenv("PDO_E2E_MODEL", "old-model")
    monkeypatch.setenv("PDO_E2E_REFERENCE_URL", "http://old-ref:8000")
    monkeypatch.setenv("PDO_E2E_LIVE_MODEL", "new-model")
    target = live_target()
    assert target is not None
    assert target.decoders == ("http://old-d:8000",)
    assert target.reference == "http://old-ref:8000"
    assert target.model == "new-model"
    assert target.preemption is False
