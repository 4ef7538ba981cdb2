"""`vllm bench serve` through the gateway asks for prompts of the length it reports.

Runs vLLM's own benchmark client (the cached vLLM CPU venv, the tiny model's
tokenizer) through a gateway over simulators, whose tokenizer is another one: the
benchmark aligns its prompts with the gateway's ``/tokenize`` and ``/detokenize``
(forwarded to the decoder), so the decoder counts the requested length. With the
alignment refused (a client key the benchmark does not send on ``/tokenize``), the
same prompts come out several times longer -- what a gateway without those routes
did. Skipped without ``PDO_E2E_VLLM_PYTHON`` / ``PDO_E2E_VLLM_MODEL`` (``make
e2e-vllm`` sets both).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_ROOT = Path(__file__).resolve().parents[1]
INPUT_LEN = 200
PROMPTS = 12


def _bench_module() -> ModuleType:
    # Loaded by path: benchmarks/ is not a package.
    path = _ROOT / "benchmarks" / "bench_serve_prompts.py"
    spec = importlib.util.spec_from_file_location("pdo_bench_serve_prompts", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_bench_serve_prompts_match_the_requested_length(
    vllm_python: Path, vllm_model: Path, tmp_path: Path
) -> None:
    bench = _bench_module()
    sizes = {"num_prompts": PROMPTS, "input_len": INPUT_LEN, "output_len": 2}
    runs = {}
    for label, key in (("aligned", None), ("refused", "bench-key")):
        with bench.sim_gateway(tmp_path, client_key=key) as (gateway, decoder):
            runs[label] = bench.measure(
                label, vllm_python, vllm_model, gateway, decoder, bench.SIM_MODEL,
                api_key=key, **sizes,
            )  # fmt: skip
    aligned, refused = runs["aligned"], runs["refused"]
    assert aligned.aligned and aligned.requests == PROMPTS
    assert 0.97 <= aligned.ratio <= 1.03, aligned
    assert not refused.aligned and refused.ratio > 2.0, refused  # what /tokenize fixes
