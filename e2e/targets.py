"""The three targets of the end-to-end suite, and the gateway in front of them.

``PDO_E2E_TARGET`` picks one:

* ``sim`` (default): simulator processes on loopback -- a NIXL prefiller, a decoder
  with a small KV cache (so preemption can be forced) and a reference instance;
* ``vllm``: a real vLLM CPU pair with the plugin (``make e2e-vllm`` sets it up);
  the prefiller doubles as the single-instance reference;
* ``live``: GPU pairs named by ``PDO_E2E_LIVE_DECODE_URLS`` and
  ``PDO_E2E_LIVE_PREFILL_URLS`` (comma lists) serving ``PDO_E2E_LIVE_MODEL``; tests
  are skipped when they are unset (``make e2e-live`` refuses to start instead).
  ``PDO_E2E_LIVE_REFERENCE_URL`` (default: the first prefiller) answers the
  reference requests, ``PDO_E2E_LIVE_CONNECTOR`` picks the gateway's connector
  (default ``nixl``), ``PDO_E2E_LIVE_BLOCK_SIZE`` is the servers' KV block size
  (default 16) and ``PDO_E2E_LIVE_PREEMPTION=1`` runs the preemption test (it
  needs a decoder whose KV cache the test can fill). Each variable may also be
  spelled without ``LIVE_`` (``PDO_E2E_DECODE_URLS``, ...), the earlier names; the
  ``LIVE_`` spelling wins when both are set.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from pd_orchestrator.children import Child, python_command, start_child, stop_child

SIM_MODEL = "sim-model"
HEALTH = {"interval": 2.0, "timeout": 5.0, "unhealthy_after": 3}
"""Health checks for a loaded 2-core machine: a busy CPU vLLM answers ``/health``
late. (Routing does not depend on them being quick: a late check does not count
against an endpoint that answers requests, and with none healthy the gateway routes
to all of them.)"""
READY_SECONDS = 120.0
METRICS_SECONDS = 60.0
"""A ``/metrics`` read's timeout: a one-core CPU vLLM on a loaded 2-core machine has
taken over 10 s to render it right after a KV hand-over (the suite's tests have
minutes each)."""


@dataclass(frozen=True)
class Target:
    """Where the suite sends traffic."""

    name: str
    model: str
    decoders: tuple[str, ...]
    prefillers: tuple[str, ...]
    reference: str
    connector: str = "nixl"
    preemption: bool = True
    block_size: int = 16
    #: the ``kv`` block of each endpoint, by URL (where its KV side channels listen)
    kv: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def _endpoint(self, name: str, url: str) -> dict[str, Any]:
        endpoint: dict[str, Any] = {"name": name, "url": url, "model": self.model}
        if url in self.kv:
            endpoint["kv"] = dict(self.kv[url])
        return endpoint

    def gateway_config(self, **overrides: Any) -> dict[str, Any]:
        config: dict[str, Any] = {
            "connector": self.connector,
            "decoders": [self._endpoint(f"decode-{i}", url) for i, url in enumerate(self.decoders)],
            "prefillers": [
                self._endpoint(f"prefill-{i}", url) for i, url in enumerate(self.prefillers)
            ],
            "threshold": {"policy": {"type": "static", "value": 0.5}},
            # Raised for CPU servers on a 2-core CI box, whose busy threads can hold
            # the gateway's event loop off the CPU: under the preemption test's load a
            # decode leg to the vLLM decoder once failed to connect mid-stream
            # ("unavailable during decode"; the default connect timeout is 2 s).
            "timeouts": {"connect": 10, "decode_attempt": 120, "prefill": 120, "decode": 120},
            "health": HEALTH,
        }
        config.update(overrides)
        return config


def _sim(stack: ExitStack, name: str, *args: str) -> Child:
    argv = python_command("sim", "--host", "127.0.0.1", "--port", "0", *args)
    child = start_child(name, argv, timeout=30)
    stack.callback(stop_child, child)
    return child


@contextmanager
def sim_target() -> Iterator[Target]:
    """A simulated pair: instant prefiller, small real-time-ish decoder, reference."""
    with ExitStack() as stack:
        nixl = ("--kv-connector", "nixl", "--model", SIM_MODEL)
        prefiller = _sim(stack, "prefiller", "--profile", "instant", *nixl)
        decoder = _sim(
            stack, "decoder", "--profile", "h200-llama3-8b", "--time-scale", "0.3",
            "--num-kv-blocks", "64", "--max-num-seqs", "8", *nixl,
        )  # fmt: skip
        reference = _sim(stack, "reference", "--profile", "instant", "--model", SIM_MODEL)
        yield Target("sim", SIM_MODEL, (decoder.url,), (prefiller.url,), reference.url)


def vllm_target(pair: Any) -> Target:
    """The real vLLM CPU pair (its prefiller is the greedy single-instance reference),
    with the connector it was started with and each server's NIXL side channel."""
    return Target(
        "vllm",
        pair.config.served_model_name,
        (pair.decoder.url,),
        (pair.prefiller.url,),
        pair.prefiller.url,
        connector=pair.config.connector,
        block_size=pair.config.block_size,
        kv={
            server.url: {"host": "127.0.0.1", "nixl_port": server.side_channel_port}
            for server in pair.servers
        },
    )


def live_setting(name: str, default: str = "") -> str:
    """``PDO_E2E_LIVE_<name>``, else the earlier ``PDO_E2E_<name>``, else ``default``."""
    return os.environ.get(f"PDO_E2E_LIVE_{name}") or os.environ.get(f"PDO_E2E_{name}") or default


def _urls(name: str) -> list[str]:
    return [u.strip() for u in live_setting(name).split(",") if u.strip()]


def live_target() -> Target | None:
    """GPU pairs from the environment, or None when they are not named."""
    decoders = _urls("DECODE_URLS")
    prefillers = _urls("PREFILL_URLS")
    model = live_setting("MODEL")
    if not decoders or not prefillers or not model:
        return None
    return Target(
        "live",
        model,
        tuple(decoders),
        tuple(prefillers),
        live_setting("REFERENCE_URL", prefillers[0]),
        connector=live_setting("CONNECTOR", "nixl"),
        preemption=live_setting("PREEMPTION") == "1",
        block_size=int(live_setting("BLOCK_SIZE", "16")),
    )


@contextmanager
def gateway_for(target: Target, workdir: Path, **overrides: Any) -> Iterator[Child]:
    """``pd-orchestrator serve`` in front of ``target``; stopped on exit."""
    path = workdir / f"gateway-{target.name}.yaml"
    path.write_text(yaml.safe_dump(target.gateway_config(**overrides)))
    child = start_child("gateway", python_command("serve", "--config", str(path), "--port", "0"))
    try:
        wait_ready(child.url)
        yield child
    finally:
        stop_child(child)


def wait_ready(gateway: str, timeout: float = READY_SECONDS) -> None:
    """Until ``gateway``'s ``/ready`` answers 200 (its first health checks passed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{gateway}/ready", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway {gateway} was not ready after {timeout:.0f} s")
        time.sleep(0.2)


def warm_up(gateway: str, target: Target, timeout: float = 600.0) -> None:
    """One P/D hand-over through ``gateway`` (a cold prompt of 64 token ids)."""
    body = {"model": target.model, "prompt": [7, 11, 13] * 64, "max_tokens": 2, "temperature": 0}
    answer = httpx.post(f"{gateway}/v1/completions", json=body, timeout=timeout)
    if answer.status_code != 200:
        raise RuntimeError(
            f"warm-up through the gateway failed: {answer.status_code} {answer.text}"
        )


def metric_in(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in Prometheus ``text`` whose labels include
    ``labels`` (0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or line.split("{", 1)[0].split(" ", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric(url: str, name: str, **labels: str) -> float:
    """:func:`metric_in` over the ``/metrics`` of the server at ``url``."""
    return metric_in(httpx.get(f"{url}/metrics", timeout=METRICS_SECONDS).text, name, **labels)
