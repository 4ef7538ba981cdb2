from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.sim.generation import advance, advance_all, initial_state, next_token
from pd_orchestrator.sim.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE, WORD_BASE


def _generate(prompt: list[int], count: int, seed: int = 0, model: str = "m") -> list[int]:
    state = advance_all(initial_state(seed, model), prompt)
    out = []
    for _ in range(count):
        token = next_token(state, allow_eos=False)
        out.append(token)
        state = advance(state, token)
    return out


@given(
    st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40),
    st.integers(0, 30),
)
def test_resubmitting_prompt_plus_outputs_continues_identically(prompt: list[int], k: int) -> None:
    full = _generate(prompt, 30)
    resumed = _generate(prompt + full[:k], 30 - k)
    assert full[k:] == resumed


def test_seed_and_model_change_the_output() -> None:
    prompt = [1, 2, 3]
    assert _generate(prompt, 8, seed=0) != _generate(prompt, 8, seed=1)
    assert _generate(prompt, 8, model="a") != _generate(prompt, 8, model="b")
    assert _generate(prompt, 8) == _generate(prompt, 8)


def test_eos_is_drawn_by_the_same_rule_and_suppressible() -> None:
    state = initial_state(0, "m")
    for token in range(5000):
        candidate = advance(state, token)
        if next_token(candidate, allow_eos=True) == EOS_TOKEN_ID:
            suppressed = next_token(candidate, allow_eos=False)
            assert suppressed >= WORD_BASE
            return
    raise AssertionError("no EOS state found in 5000 candidates")
