"""Start a real vLLM prefiller and decoder on loopback, NIXL over CPU, with the plugin.

Runs from the project's own venv (httpx, and the project's port picker for the
ports the servers bind late); each server is a subprocess of the cached vLLM venv's
python (``e2e/vllm_cpu/build-env.sh`` prints it). Both servers
load the tiny model (``e2e/vllm_cpu/tiny_model.py``) with the NixlConnector
(``kv_role: kv_both``, ``kv_buffer_device: cpu``), prefix caching, prompt-token
details, ``--enforce-eager``, a fixed ``PYTHONHASHSEED``, ``HF_HUB_OFFLINE=1``, a
private ``VLLM_CACHE_ROOT``, their own NIXL side-channel port and one CPU core each.

As a library (pytest fixtures)::

    with VLLMPair(PairConfig(python=..., model=...)) as pair:
        pair.prefiller.url, pair.decoder.url, pair.decoder.version

As a command::

    python e2e/vllm_cpu/pair.py --python PY --model DIR [--small-decoder] [--hold]

Everything started is stopped on exit: each server runs in its own process group,
which gets SIGTERM, then SIGKILL after a bounded wait.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from pd_orchestrator.bench.peers import free_port

__all__ = [
    "SITE_DIR",
    "SMALL_DECODER_ARGS",
    "PairConfig",
    "ServerError",
    "ServerSpec",
    "VLLMPair",
    "VLLMServer",
    "free_port",
]

#: Decoder flags that make preemption easy to force: 24 blocks of 32 tokens.
SMALL_DECODER_ARGS: tuple[str, ...] = (
    "--num-gpu-blocks-override",
    "24",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
)

#: The connectors a pair can run, by the gateway's names (``connectors/``), and the
#: vLLM connector classes behind each (a ``multi:`` spec composes its children, in
#: order, under vLLM's ``MultiConnector``).
CONNECTORS: dict[str, tuple[str, ...]] = {
    "nixl": ("NixlConnector",),
    "nixl-push": ("NixlPushConnector",),
    "example": ("ExampleConnector",),
    "multi:nixl,example": ("NixlConnector", "ExampleConnector"),
}


def kv_transfer_config(connector: str, engine_id: str, shared_dir: Path) -> dict[str, object]:
    """One server's ``--kv-transfer-config`` for ``connector`` (a key of :data:`CONNECTORS`).

    Every connector is ``kv_both`` with ``kv_buffer_device: cpu`` and the given
    ``engine_id`` (so the gateway can be told it); ``ExampleConnector`` keeps its files
    in ``shared_dir``, which both servers of a pair share.
    """
    try:
        classes = CONNECTORS[connector]
    except KeyError:
        known = ", ".join(CONNECTORS)
        raise ValueError(f"unknown connector {connector!r} (known: {known})") from None
    children = [_child_config(name, shared_dir) for name in classes]
    base: dict[str, object] = {
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
    }
    if len(children) == 1:
        return base | children[0]
    composed = [{"kv_role": "kv_both", "kv_buffer_device": "cpu"} | c for c in children]
    extra = {"connectors": composed}
    return base | {"kv_connector": "MultiConnector", "kv_connector_extra_config": extra}


def _child_config(name: str, shared_dir: Path) -> dict[str, object]:
    config: dict[str, object] = {"kv_connector": name}
    if name == "ExampleConnector":
        config["kv_connector_extra_config"] = {"shared_storage_path": str(shared_dir)}
    return config


#: Put on every server's ``PYTHONPATH``: its ``sitecustomize`` keeps the NIXL progress
#: thread from busy-polling (an idle server would otherwise spend a whole core).
SITE_DIR = Path(__file__).resolve().parent / "site"

_STOP_SECONDS = 20.0
#: ``SomeError: message`` (the last part of a traceback), wherever it sits in a log line
_EXCEPTION_LINE = re.compile(r"\b[A-Za-z_][\w.]*(?:Error|Exception): .*$")
#: a vLLM log record below ERROR (``WARNING 11-28 19:55:35 [file.py:1] ...``): one may
#: quote an exception (the ulimit warning quotes ``OSError: [Errno 24] ...``) but is none
_BELOW_ERROR = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d ")


class ServerError(RuntimeError):
    """A server did not start or died; the message ends with its log's tail."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One vLLM server: its name, the core it is pinned to and its extra flags/env."""

    name: str
    cpu: int | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PairConfig:
    """What :class:`VLLMPair` starts."""

    python: Path
    model: Path
    served_model_name: str = "tiny"
    block_size: int = 32
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    startup_timeout: float = 240.0
    global_threshold: float | None = None
    small_decoder: bool = False
    prefiller_args: tuple[str, ...] = ()
    decoder_args: tuple[str, ...] = ()
    hash_seed: str = "0"
    connector: str = "nixl"

    def specs(self) -> tuple[ServerSpec, ServerSpec]:
        """Prefiller on core 0, decoder on core 1 (with the small KV cache if asked)."""
        small = SMALL_DECODER_ARGS if self.small_decoder else ()
        return (
            ServerSpec("prefiller", cpu=0, extra_args=self.prefiller_args),
            ServerSpec("decoder", cpu=1, extra_args=small + self.decoder_args),
        )


class VLLMServer:
    """One vLLM OpenAI server subprocess in its own process group."""

    def __init__(self, config: PairConfig, spec: ServerSpec, workdir: Path) -> None:
        self.config = config
        self.spec = spec
        self.port = free_port()
        self.side_channel_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_id = f"{spec.name}-{self.port}"
        self.shared_dir = workdir / "shared-kv"
        self.workdir = workdir / spec.name
        self.log_path = self.workdir / "server.log"
        self.version: str | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        """The server's command line (last flags win, so ``extra_args`` override)."""
        config = self.config
        argv = [
            str(config.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(config.model),
            "--served-model-name",
            config.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--block-size",
            str(config.block_size),
            "--max-model-len",
            str(config.max_model_len),
            "--kv-transfer-config",
            json.dumps(kv_transfer_config(config.connector, self.engine_id, self.shared_dir)),
        ]
        if config.global_threshold is not None:
            argv += ["--global-cache-hit-threshold", str(config.global_threshold)]
        return argv + list(self.spec.extra_args)

    def env(self) -> dict[str, str]:
        """The server's environment: this one's, plus the per-server settings."""
        env = dict(os.environ)
        for name in ("PYTHONPATH", "VIRTUAL_ENV", "PDO_GLOBAL_CACHE_HIT_THRESHOLD"):
            env.pop(name, None)
        env.update(
            PYTHONPATH=str(SITE_DIR),
            PYTHONHASHSEED=self.config.hash_seed,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CACHE_ROOT=str(self.workdir / "vllm-cache"),
            VLLM_CPU_KVCACHE_SPACE=str(self.config.kv_cache_gib),
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if self.spec.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.spec.cpu)
        else:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
        env.update(self.spec.extra_env)
        return env

    def start(self) -> None:
        """Launch the process (returns at once; see :meth:`wait_ready`)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.argv(),
                cwd=self.workdir,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # its own process group in the caller's session: a server in a new
                # session is a scheduling group of its own (autogroup), and its
                # busy-polling engine kept the other processes off the cores for
                # seconds (pd_orchestrator/children.py)
                process_group=0,
            )

    def wait_ready(self, deadline: float) -> None:
        """Poll ``/health`` until 200, then read ``/version``; :class:`ServerError` if not."""
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self._process is None or self._process.poll() is not None:
                    raise ServerError(f"{self.spec.name} exited early\n{self.report()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        self.version = client.get(f"{self.url}/version").json()["version"]
                        return
                time.sleep(0.5)
        raise ServerError(f"{self.spec.name} not healthy in time\n{self.report()}")

    def tail(self, lines: int = 60) -> str:
        """The last lines of the server log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def errors(self, limit: int = 12) -> list[str]:
        """The distinct exception lines of the log, first seen first (an engine that
        fails in a worker logs the root cause far above the tail); records logged
        below ERROR are not exceptions, whatever they quote."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        seen: dict[str, None] = {}
        for line in text.splitlines():
            match = _EXCEPTION_LINE.search(line)
            if match is not None and _BELOW_ERROR.search(line) is None:
                seen.setdefault(match.group(0).strip(), None)
        return list(seen)[:limit]

    def report(self) -> str:
        """The exception lines, then the tail of the log."""
        errors = "\n".join(f"  {line}" for line in self.errors()) or "  (none)"
        return f"exceptions in the log:\n{errors}\nlog tail:\n{self.tail()}"

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after a bounded wait."""
        process, self._process = self._process, None
        if process is None:
            return
        for sig, wait in ((signal.SIGTERM, _STOP_SECONDS), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            break
        # Children of a killed leader may linger in the group; make sure none do.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


class VLLMPair:
    """A prefiller and a decoder, started together, stopped together."""

    def __init__(self, config: PairConfig, workdir: Path | None = None) -> None:
        self.config = config
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="pdo-vllm-pair-"))
        prefill_spec, decode_spec = config.specs()
        self.prefiller = VLLMServer(config, prefill_spec, self.workdir)
        self.decoder = VLLMServer(config, decode_spec, self.workdir)
        self.startup_seconds: float | None = None

    @property
    def servers(self) -> tuple[VLLMServer, VLLMServer]:
        return self.prefiller, self.decoder

    def start(self) -> None:
        """Start both servers and wait until both answer ``/health``."""
        started = time.monotonic()
        deadline = started + self.config.startup_timeout
        try:
            for server in self.servers:
                server.start()
            errors: list[BaseException] = []
            threads = [
                threading.Thread(target=_collect, args=(server.wait_ready, deadline, errors))
                for server in self.servers
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise errors[0]
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def stop(self) -> None:
        """Stop both servers; remove the work folder if this pair made it."""
        for server in self.servers:
            server.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> VLLMPair:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _collect(wait: Callable[[float], None], deadline: float, errors: list[BaseException]) -> None:
    try:
        wait(deadline)
    except BaseException as exc:
        errors.append(exc)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Start a vLLM prefiller + decoder pair (NIXL on CPU, threshold plugin) "
        "on loopback, print their URLs and versions, and stop them on exit."
    )
    parser.add_argument("--python", type=Path, default=os.environ.get("PDO_E2E_VLLM_PYTHON"))
    parser.add_argument("--model", type=Path, default=os.environ.get("PDO_E2E_VLLM_MODEL"))
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument(
        "--connector", choices=sorted(CONNECTORS), default="nixl", help="the KV connector"
    )
    parser.add_argument("--global-threshold", type=float, default=None)
    parser.add_argument(
        "--small-decoder",
        action="store_true",
        help="decoder with 24 KV blocks, max-model-len 512, max-num-seqs 8 (forces preemption)",
    )
    parser.add_argument(
        "--prefiller-arg", action="append", default=[], help="extra vLLM flag (repeatable)"
    )
    parser.add_argument(
        "--decoder-arg", action="append", default=[], help="extra vLLM flag (repeatable)"
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="start-up timeout (s)")
    parser.add_argument("--hold", action="store_true", help="keep serving until interrupted")
    args = parser.parse_args(argv)
    if args.python is None or args.model is None:
        parser.error("--python and --model (or PDO_E2E_VLLM_PYTHON / PDO_E2E_VLLM_MODEL) needed")
    config = PairConfig(
        python=args.python,
        model=args.model,
        block_size=args.block_size,
        startup_timeout=args.timeout,
        global_threshold=args.global_threshold,
        small_decoder=args.small_decoder,
        prefiller_args=tuple(args.prefiller_arg),
        decoder_args=tuple(args.decoder_arg),
        connector=args.connector,
    )
    with _sigterm_as_exit(), VLLMPair(config) as pair:
        for server in pair.servers:
            print(f"{server.spec.name}: {server.url} vLLM {server.version}", flush=True)
        print(f"started in {pair.startup_seconds:.1f} s", flush=True)
        if args.hold:
            with contextlib.suppress(KeyboardInterrupt):
                while all(server.alive() for server in pair.servers):
                    time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
