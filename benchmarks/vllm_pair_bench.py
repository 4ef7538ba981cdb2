"""P/D path vs decode-only path through the gateway on the real vLLM CPU pair.

Starts the cached vLLM CPU pair (``make vllm-env`` and ``make tiny-model`` build
it; pass ``--python`` and ``--model`` or the ``PDO_E2E_VLLM_*`` variables) and a
gateway in front, then times, with the same prompt sizes: cold prompts through the
gateway (decision ``pd``: rejection, prefill, NIXL pull, decode), the same prompts
again (decision ``decode``: admitted on the decoder), and straight to the decoder
without the gateway (the baseline).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from _common import console

from pd_orchestrator.children import python_command, start_child, stop_child

ROOT = Path(__file__).resolve().parents[1]


def _pair_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "vllm_pair", ROOT / "e2e" / "vllm_cpu" / "pair.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _timed(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, str | None]:
    started = time.perf_counter()
    response = client.post(url, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text}")
    return time.perf_counter() - started, response.headers.get("x-pd-decision")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--python", type=Path, default=os.environ.get("PDO_E2E_VLLM_PYTHON"))
    parser.add_argument("--model", type=Path, default=os.environ.get("PDO_E2E_VLLM_MODEL"))
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.python is None or args.model is None:
        raise SystemExit("pass --python and --model (or set PDO_E2E_VLLM_PYTHON/_MODEL)")
    pair_module = _pair_module()
    started = time.perf_counter()
    with pair_module.VLLMPair(pair_module.PairConfig(python=args.python, model=args.model)) as pair:
        startup = time.perf_counter() - started
        config = {
            "decoders": [{"name": "decoder", "url": pair.decoder.url, "model": "tiny"}],
            "prefillers": [{"name": "prefiller", "url": pair.prefiller.url, "model": "tiny"}],
            "threshold": {"policy": {"value": 0.5}},
            "timeouts": {"decode_attempt": 120, "prefill": 120, "decode": 120},
        }
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "gateway.yaml"
            path.write_text(yaml.safe_dump(config))
            gateway = start_child(
                "gateway", python_command("serve", "--config", str(path), "--port", "0")
            )
            try:
                results = _measure(gateway.url, pair.decoder.url, args)
            finally:
                stop_child(gateway)
    console.print(f"vLLM {pair.decoder.version} pair up in {startup:.1f} s")
    for name, (values, decisions) in results.items():
        p90 = sorted(values)[int(0.9 * (len(values) - 1))]
        console.print(
            f"  {name:<26} median {statistics.median(values) * 1e3:7.1f} ms  "
            f"p90 {p90 * 1e3:7.1f} ms  decisions {decisions}"
        )
    base = statistics.median(results["decoder direct (warm)"][0])
    for name, (values, _) in results.items():
        console.print(f"  {name:<26} / decoder direct = {statistics.median(values) / base:.2f}")


def _measure(
    gateway: str, decoder: str, args: argparse.Namespace
) -> dict[str, tuple[list[float], set[str | None]]]:
    rng = random.Random(7)
    prompts = [
        [rng.randrange(1000, 3000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    common = {"model": "tiny", "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
    results: dict[str, tuple[list[float], set[str | None]]] = {}
    with httpx.Client(timeout=120) as client:
        _timed(client, gateway + "/v1/completions", common | {"prompt": [5] * 64})  # warm-up
        for name, url in (
            ("gateway cold (pd)", gateway),
            ("gateway warm (decode)", gateway),
            ("decoder direct (warm)", decoder),
        ):
            timings, decisions = [], set()
            for prompt in prompts:
                elapsed, decision = _timed(
                    client, url + "/v1/completions", common | {"prompt": prompt}
                )
                timings.append(elapsed)
                decisions.add(decision)
            results[name] = (timings, decisions)
    return results


if __name__ == "__main__":
    main()
