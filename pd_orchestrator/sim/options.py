"""Settings of one simulated vLLM instance (``pd-orchestrator sim`` flags)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from connectors import parse_spec
from pd_orchestrator.model.hardware import LatencyProfile
from pd_orchestrator.model.hashing import HashAlgo
from pd_orchestrator.model.measured import resolve_profile
from pd_orchestrator.model.records import record
from pd_orchestrator.prefix.hashing import hash_function
from pd_orchestrator.sim.faults import ProtocolFault

__all__ = ["LoadFailurePolicy", "SimOptions", "connector_names"]

LoadFailurePolicy = Literal["fail", "recompute"]


def connector_names(spec: str) -> tuple[str, ...]:
    """The connectors a ``--kv-connector`` spec stands for (none for ``none``)."""
    return () if spec == "none" else parse_spec(spec)


@record
class SimOptions:
    """Everything that shapes a simulated instance; defaults mirror vLLM's.

    ``hash_seed`` is vLLM's ``PYTHONHASHSEED`` (None: unset) and ``hash_algo`` its
    ``--prefix-caching-hash-algo``. The ``kv_events_*`` fields mirror vLLM's
    ``--kv-events-config`` (``endpoint``, ``replay_endpoint``, ``topic``,
    ``buffer_steps``); ``kv_events_int_hashes`` is vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default on: hashes go out as 64-bit ints).
    ``kv_connector`` is a connector spec (``none``, ``nixl``, ``nixl-push``,
    ``mooncake``, ``moriio``, ``offloading``, ``lmcache``, ``example``,
    ``multi:A,B``; see :mod:`pd_orchestrator.sim.handover`); ``lmcache_chunk_size``
    is LMCache's ``chunk_size`` (a multiple of the block size). ``api_keys`` is vLLM's
    ``--api-key``: requests to ``/v1/...`` need ``Authorization: Bearer <a key>``. Fault hooks:
    ``failure_rate``, ``drop_after_tokens``, ``response_delay`` (seconds each
    completion request waits before the instance takes it: a slow server),
    ``health_delay`` (seconds ``/health`` takes: a busy one), ``lease_seconds``
    (0: produced KV is gone before any consumer can pull it), ``always_reject``
    (``cache_threshold`` for every request, whatever its threshold) and
    ``protocol_fault`` (answers no vLLM would send: :mod:`pd_orchestrator.sim.faults`).
    ``admission_only`` (default on): the simulated plugin honours
    ``cache_hit_admission_only`` and says so (``vllm:cache_threshold_admission_only``);
    off, it is an older plugin that ignores the field and exports no such gauge.
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str | None = None
    profile: str = "h200-llama3-8b"
    time_scale: float = 1.0
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131_072
    global_cache_hit_threshold: float = 0.0
    kv_connector: str = "none"
    engine_id: str | None = None
    seed: int = 0
    hash_seed: str | None = None
    hash_algo: HashAlgo = "sha256"
    lease_seconds: float = 30.0
    kv_shared_dir: Path | None = None
    lmcache_chunk_size: int = 256
    kv_load_failure_policy: LoadFailurePolicy = "fail"
    side_channel_host: str | None = None
    failure_rate: float = 0.0
    drop_after_tokens: int | None = None
    response_delay: float = 0.0
    health_delay: float = 0.0
    fault_seed: int | None = None
    always_reject: bool = False
    admission_only: bool = True
    protocol_fault: ProtocolFault | None = None
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    kv_events_int_hashes: bool = True
    api_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        resolve_profile(self.profile)
        if not 0.0 <= self.global_cache_hit_threshold <= 1.0:
            raise ValueError("global cache hit threshold must be within [0, 1]")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure rate must be within [0, 1]")
        if self.time_scale < 0:
            raise ValueError("time scale must be >= 0")
        if self.response_delay < 0 or self.health_delay < 0 or self.lease_seconds < 0:
            raise ValueError("delays and the lease must be >= 0")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block size, max-num-seqs and max-num-batched-tokens must be >= 1")
        hash_function(self.hash_algo)
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("a KV-events replay endpoint needs a KV-events endpoint")
        if self.kv_events_buffer_steps < 1:
            raise ValueError("the KV-events replay buffer must hold at least one batch")
        names = connector_names(self.kv_connector)  # ValueError/KeyError name the culprit
        if "lmcache" in names and (
            self.lmcache_chunk_size < self.block_size or self.lmcache_chunk_size % self.block_size
        ):
            raise ValueError("the LMCache chunk size must be a multiple of the block size")

    @property
    def latency(self) -> LatencyProfile:
        return resolve_profile(self.profile)

    @property
    def served_model(self) -> str:
        return self.model or self.latency.model

    @property
    def kv_blocks(self) -> int:
        """KV blocks: the flag, or the profile's capacity in tokens over the block size."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, self.latency.capacity_tokens // self.block_size)
