"""Fixtures for the end-to-end suites that need a real vLLM.

They run from the project's venv. ``PDO_E2E_VLLM_PYTHON`` names the python of the
cached vLLM CPU venv (``make vllm-env`` prints it) and ``PDO_E2E_VLLM_MODEL`` the
tiny model folder (``make tiny-model``); without both, every test that needs them
is skipped with that reason. ``make e2e-vllm`` sets both.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent

# The vLLM 0.33 suite runs inside its own venv (make plugin-vllm033), not here.
collect_ignore = ["vllm033"]


def _load_pair_module() -> ModuleType:
    # Loaded by path: e2e/ is not a package.
    spec = importlib.util.spec_from_file_location(
        "pdo_e2e_vllm_pair", _HERE / "vllm_cpu" / "pair.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pair_module = _load_pair_module()


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's python, or skip."""
    python = _env_path("PDO_E2E_VLLM_PYTHON")
    if python is None:
        pytest.skip("PDO_E2E_VLLM_PYTHON is not set (run `make e2e-vllm`)")
    if not python.exists():
        pytest.fail(f"PDO_E2E_VLLM_PYTHON={python} does not exist")
    return python


@pytest.fixture(scope="session")
def vllm_model(vllm_python: Path) -> Path:
    """The tiny model folder, or skip."""
    model = _env_path("PDO_E2E_VLLM_MODEL")
    if model is None:
        pytest.skip("PDO_E2E_VLLM_MODEL is not set (run `make e2e-vllm`)")
    if not (model / "config.json").is_file():
        pytest.fail(f"PDO_E2E_VLLM_MODEL={model} holds no config.json")
    return model


@pytest.fixture(scope="session")
def vllm_kv_events(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Where the pair's decoder publishes its KV events: PUB on an ipc socket (vLLM
    binds ipc and wildcard endpoints only) and the replay ROUTER on loopback."""
    directory = tmp_path_factory.mktemp("kv-events")
    return {
        "publisher": f"ipc://{directory}/decoder.sock",
        "replay": f"tcp://127.0.0.1:{pair_module.free_port()}",
        "topic": "kv-events",
    }


@pytest.fixture(scope="session")
def vllm_pair(
    vllm_python: Path, vllm_model: Path, vllm_kv_events: dict[str, str]
) -> Iterator[object]:
    """A prefiller (server default threshold 0.5) and a small-cache decoder (no default)
    that publishes its KV events (``vllm_kv_events``); both parse tool calls."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": vllm_kv_events["publisher"],
        "replay_endpoint": vllm_kv_events["replay"],
        "topic": vllm_kv_events["topic"],
    }
    # named tool choices need a tool-call parser (pythonic: the tiny model's tokenizer
    # has none of the special tokens the others look for); without free whitespace a
    # random model's constrained JSON ends within a few tokens
    grammar = {"backend": "xgrammar", "disable_any_whitespace": True}
    tools = (
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
        "--structured-outputs-config", json.dumps(grammar),
    )  # fmt: skip
    config = pair_module.PairConfig(
        python=vllm_python,
        model=vllm_model,
        small_decoder=True,
        prefiller_args=("--global-cache-hit-threshold", "0.5", *tools),
        decoder_args=("--kv-events-config", json.dumps(events), *tools),
    )
    with pair_module.VLLMPair(config) as pair:
        sys.stderr.write(
            f"\nvLLM pair up in {pair.startup_seconds:.1f} s: prefiller {pair.prefiller.url} "
            f"decoder {pair.decoder.url}, vLLM {pair.decoder.version}\n"
        )
        yield pair


@pytest.fixture(scope="session")
def vllm_pair_factory(vllm_python: Path, vllm_model: Path) -> Callable[..., Any]:
    """Builds a (not yet started) pair of the cached venv and tiny model:
    ``with vllm_pair_factory(connector="example", small_decoder=True) as pair: ...``
    (keyword arguments are :class:`PairConfig` fields)."""

    def build(**fields: Any) -> Any:
        config = pair_module.PairConfig(python=vllm_python, model=vllm_model, **fields)
        return pair_module.VLLMPair(config)

    return build


# --- the gateway suite's targets ------------------------------------------------------
from targets import (  # noqa: E402
    Target,
    gateway_for,
    live_target,
    sim_target,
    vllm_target,
    warm_up,
)


@pytest.fixture(scope="session")
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """The target named by ``PDO_E2E_TARGET`` (``sim`` by default)."""
    name = os.environ.get("PDO_E2E_TARGET", "sim")
    if name == "sim":
        with sim_target() as simulated:
            yield simulated
    elif name == "vllm":
        yield vllm_target(request.getfixturevalue("vllm_pair"))
    elif name == "live":
        live = live_target()
        if live is None:
            pytest.skip(
                "PDO_E2E_LIVE_DECODE_URLS, PDO_E2E_LIVE_PREFILL_URLS and PDO_E2E_LIVE_MODEL "
                "are not set"
            )
        yield live
    else:
        pytest.fail(f"PDO_E2E_TARGET={name!r}: expected sim, vllm or live")


@pytest.fixture(scope="session")
def gateway(target: Target, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway's URL, in front of the target, after one warm-up hand-over.

    The first P/D on a fresh pair pays one-time costs (the NIXL handshake, first
    kernels); the warm-up keeps them out of the tests' own time limits.
    """
    with gateway_for(target, tmp_path_factory.mktemp("gateway")) as child:
        warm_up(child.url, target)
        yield child.url
