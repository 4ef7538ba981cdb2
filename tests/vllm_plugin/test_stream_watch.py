"""The stream patch's bookkeeping, exercised with plain engine-output stand-ins."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from pd_orchestrator.vllm_plugin._frontend import _NotedRejections, _StreamWatch
from pd_orchestrator.vllm_plugin.policy import Phase


@dataclass
class Output:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Result:
    outputs: list[Output]


def chunk_for(prompt_index: int, output: Output, result: Result) -> str:
    return f"finish:{prompt_index}:{output.index}"


async def source(*items: object) -> AsyncIterator[object]:
    for item in items:
        yield item


async def relay(watch: _StreamWatch, items: list[Result], role_chunk: bool) -> list[str]:
    """Mimic vLLM's chat stream generator: role chunk first, skip empty outputs."""
    written: list[str] = []
    first = True
    async for result in watch.tap(source(*items), keyed=False):
        pending: list[str] = []
        if first and role_chunk:
            pending.append("role")
        first = False
        for output in result.outputs:
            if output.text or output.token_ids:
                pending.append(f"token:{output.text}")
        for data in pending:
            written.extend(watch.take_ready())
            written.append(data)
    written.extend(watch.take_ready())
    written.append("[DONE]")
    return written


@pytest.mark.anyio
async def test_rejected_empty_choice_gets_a_finish_chunk_after_the_role_chunk() -> None:
    watch = _StreamWatch(chunk_for, skip=False)
    items = [Result([Output(0, finish_reason="cache_threshold")])]
    assert await relay(watch, items, role_chunk=True) == ["role", "finish:0:0", "[DONE]"]


@pytest.mark.anyio
async def test_handed_back_choice_with_tokens_gets_no_extra_chunk() -> None:
    watch = _StreamWatch(chunk_for, skip=False)
    items = [
        Result([Output(0, text="a", token_ids=[5])]),
        Result([Output(0, finish_reason="cache_threshold")]),
    ]
    assert await relay(watch, items, role_chunk=False) == ["token:a", "[DONE]"]


@pytest.mark.anyio
async def test_other_finish_reasons_and_skip_mode_add_nothing() -> None:
    items = [Result([Output(0, finish_reason="abort")])]
    assert await relay(_StreamWatch(chunk_for, skip=False), items, False) == ["[DONE]"]
    items = [Result([Output(0, finish_reason="cache_threshold")])]
    assert await relay(_StreamWatch(chunk_for, skip=True), items, False) == ["[DONE]"]


@pytest.mark.anyio
async def test_keyed_sources_track_choices_per_prompt() -> None:
    watch = _StreamWatch(chunk_for, skip=False)
    items = [(0, Result([Output(0, text="x", token_ids=[1])])), (1, Result([Output(0)]))]
    seen = [item async for item in watch.tap(source(*items), keyed=True)]
    assert seen == items
    watch.observe(1, Result([Output(0, finish_reason="cache_threshold")]))
    watch.observe(0, Result([Output(0, finish_reason="cache_threshold")]))
    watch.release()
    assert watch.take_ready() == ["finish:1:0"]


def test_noted_rejections_pop_in_order_and_stay_bounded() -> None:
    noted = _NotedRejections(limit=2)
    noted.note("a", Phase.ADMISSION)
    noted.note("a", Phase.PREEMPTION)
    assert noted.take("a") is Phase.ADMISSION
    assert noted.take("a") is Phase.PREEMPTION
    assert noted.take("a") is None
    for name in ("x", "y", "z"):
        noted.note(name, Phase.ADMISSION)
    assert noted.take("x") is None
    assert noted.take("z") is Phase.ADMISSION
    assert noted.take(None) is None
