"""`vllm bench serve` through the gateway: do the prompts have the length asked for?

`vllm bench serve` samples random prompts with its own tokenizer (`--tokenizer`),
then asks the server's `/tokenize` how long they really are and, when the two
tokenizers disagree, cuts them to the requested length with the server's
`/tokenize` and `/detokenize`. A gateway that does not forward those routes leaves
the prompts as sampled, several times longer on the server than asked.

This script runs `vllm bench serve` (from the cached vLLM CPU venv, with the tiny
model's tokenizer) through a gateway and prints the prompt tokens the servers
counted per request against the requested input length:

* `--target sim` (default): a simulated decoder and prefiller (whose tokenizer is
  not the tiny model's), threshold 0 so every request is decoded where it is
  counted. Two runs: the gateway as it is (`/tokenize` forwarded: aligned), and a
  gateway with a client key that the benchmark sends on its requests but not on
  `/tokenize` (alignment refused: the baseline of a server without `/tokenize`).
* `--target vllm`: the real vLLM CPU pair (the tiny model's tokenizer on both
  sides: aligned by construction; proves the recipe on real vLLM).

The count comes from the decoder's `vllm:prompt_tokens_total` and the gateway's
answered requests, before and after the run.

    .venv/bin/python benchmarks/bench_serve_prompts.py [--target sim|vllm]
        [--num-prompts 32] [--input-len 256] [--output-len 4]
        [--vllm-python PY] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pd_orchestrator.children import Child, python_command, start_child, stop_child

ROOT = Path(__file__).resolve().parents[1]
SIM_MODEL = "sim-model"
GATEWAY_KEY = "bench-key"
BENCH_TIMEOUT = 600.0
START_SECONDS = 120.0  # a busy machine starts Python slowly

__all__ = ["Measurement", "measure", "sim_gateway", "vllm_tools"]


@dataclass(frozen=True)
class Measurement:
    """One `vllm bench serve` run: what was asked and what the servers counted."""

    label: str
    requested: int
    requests: int
    prompt_tokens: float
    aligned: bool

    @property
    def per_request(self) -> float:
        return self.prompt_tokens / self.requests if self.requests else 0.0

    @property
    def ratio(self) -> float:
        return self.per_request / self.requested


def vllm_tools() -> tuple[Path, Path]:
    """The cached vLLM CPU venv's python and the tiny model (built when missing)."""
    python = Path(_last_line(["bash", str(ROOT / "e2e" / "vllm_cpu" / "build-env.sh")]))
    model = Path(_last_line([str(python), str(ROOT / "e2e" / "vllm_cpu" / "tiny_model.py")]))
    return python, model


def _last_line(argv: list[str]) -> str:
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=1800)
    return out.stdout.strip().splitlines()[-1]


def _sample(text: str, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def _counts(gateway: str, decoder: str) -> tuple[float, float]:
    """(answered completions at the gateway, prompt tokens the decoder counted)."""
    with httpx.Client(timeout=10) as client:
        gateway_text = client.get(f"{gateway}/metrics").text
        decoder_text = client.get(f"{decoder}/metrics").text
    answered = _sample(
        gateway_text, "pd_orchestrator_requests_total", route="/v1/completions", code="200"
    )
    return answered, _sample(decoder_text, "vllm:prompt_tokens_total")


@contextmanager
def _gateway(config: dict[str, Any], workdir: Path) -> Iterator[Child]:
    path = workdir / f"gateway-{len(list(workdir.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = python_command("serve", "--config", str(path), "--port", "0")
    child = start_child("gateway", argv, timeout=START_SECONDS)
    try:
        yield child
    finally:
        stop_child(child)


def _config(decoder: str, prefiller: str, model: str, **extra: Any) -> dict[str, Any]:
    return {
        "decoders": [{"name": "decode-0", "url": decoder, "model": model}],
        "prefillers": [{"name": "prefill-0", "url": prefiller, "model": model}],
        "threshold": {"policy": {"value": 0.0}},  # every request decoded where it is counted
        **extra,
    }


@contextmanager
def sim_gateway(workdir: Path, *, client_key: str | None = None) -> Iterator[tuple[str, str]]:
    """(gateway URL, decoder URL) over a simulated decoder and prefiller."""
    sim = ("--profile", "instant", "--kv-connector", "nixl", "--model", SIM_MODEL)
    with ExitStack() as stack:
        children = [
            start_child(n, python_command("sim", "--port", "0", *sim), timeout=START_SECONDS)
            for n in "dp"
        ]
        for child in children:
            stack.callback(stop_child, child)
        decoder, prefiller = (child.url for child in children)
        extra = {"auth": {"api_keys": [client_key]}} if client_key else {}
        gateway = stack.enter_context(
            _gateway(_config(decoder, prefiller, SIM_MODEL, **extra), workdir)
        )
        yield gateway.url, decoder


def measure(
    label: str,
    vllm_python: Path,
    tokenizer: Path,
    gateway: str,
    decoder: str,
    model: str,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    api_key: str | None = None,
) -> Measurement:
    """Run `vllm bench serve` through ``gateway``; what the decoder counted per request."""
    before = _counts(gateway, decoder)
    argv = [
        str(vllm_python.parent / "vllm"), "bench", "serve",
        "--backend", "vllm", "--base-url", gateway, "--model", model,
        "--tokenizer", str(tokenizer), "--dataset-name", "random",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", "4", "--seed", "1",
        "--ready-check-timeout-sec", "0", "--disable-tqdm",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("OPENAI_API_KEY", None)
    if api_key is not None:
        env["OPENAI_API_KEY"] = api_key
    run = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=BENCH_TIMEOUT, check=False
    )
    output = run.stdout + run.stderr
    if run.returncode != 0 or "Successful requests:" not in output:
        raise RuntimeError(f"vllm bench serve failed ({run.returncode}):\n{output[-4000:]}")
    after = _counts(gateway, decoder)
    return Measurement(
        label,
        input_len,
        int(after[0] - before[0]),
        after[1] - before[1],
        aligned="skipping alignment" not in output,
    )


def _sim_runs(args: argparse.Namespace, python: Path, tokenizer: Path) -> list[Measurement]:
    sizes = {"num_prompts": args.num_prompts, "input_len": args.input_len,
             "output_len": args.output_len}  # fmt: skip
    setups = [("gateway, /tokenize forwarded", None), ("gateway, /tokenize refused", GATEWAY_KEY)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="pdo-bench-serve-") as tmp:
        for label, key in setups:
            with sim_gateway(Path(tmp), client_key=key) as (gateway, decoder):
                urls = (gateway, decoder, SIM_MODEL)
                runs.append(measure(label, python, tokenizer, *urls, api_key=key, **sizes))
    return runs


def _vllm_runs(args: argparse.Namespace, python: Path, tokenizer: Path) -> list[Measurement]:
    spec = importlib.util.spec_from_file_location("vllm_pair", ROOT / "e2e/vllm_cpu/pair.py")
    assert spec is not None and spec.loader is not None
    pair_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pair_module
    spec.loader.exec_module(pair_module)
    config = pair_module.PairConfig(python=python, model=tokenizer)
    with pair_module.VLLMPair(config) as pair, tempfile.TemporaryDirectory() as tmp:
        model = config.served_model_name
        gateway_config = _config(pair.decoder.url, pair.prefiller.url, model)
        with _gateway(gateway_config, Path(tmp)) as gateway:
            return [
                measure("gateway over the vLLM CPU pair", python, tokenizer, gateway.url,
                        pair.decoder.url, model, num_prompts=args.num_prompts,
                        input_len=args.input_len, output_len=args.output_len)
            ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--vllm-python", type=Path, default=None)
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: the tiny model")
    args = parser.parse_args()
    if args.vllm_python is None or args.tokenizer is None:
        python, model = vllm_tools()
        args.vllm_python = args.vllm_python or python
        args.tokenizer = args.tokenizer or model
    runner = _sim_runs if args.target == "sim" else _vllm_runs
    runs = runner(args, args.vllm_python, args.tokenizer)
    print(f"vllm bench serve, random dataset, {args.num_prompts} prompts of {args.input_len} "
          f"tokens (tokenizer {args.tokenizer.name})")  # fmt: skip
    print(f"{'setup':34} {'aligned':>8} {'requests':>9} {'tokens/request':>15} {'ratio':>7}")
    for run in runs:
        print(f"{run.label:34} {'yes' if run.aligned else 'no':>8} {run.requests:>9} "
              f"{run.per_request:>15.1f} {run.ratio:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
