"""Settings of one simulated vLLM instance (``pd-orchestrator sim`` flags)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pd_orchestrator.sim.profiles import LatencyProfile, get_profile

__all__ = ["ConnectorName", "LoadFailurePolicy", "SimOptions"]

ConnectorName = Literal["nixl", "example", "none"]
LoadFailurePolicy = Literal["fail", "recompute"]


@dataclass(frozen=True, slots=True)
class SimOptions:
    """Everything that shapes a simulated instance; defaults mirror vLLM's."""

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
    kv_connector: ConnectorName = "none"
    engine_id: str | None = None
    seed: int = 0
    hash_seed: str = "0"
    lease_seconds: float = 30.0
    kv_shared_dir: Path | None = None
    kv_load_failure_policy: LoadFailurePolicy = "fail"
    side_channel_host: str | None = None
    failure_rate: float = 0.0
    drop_after_tokens: int | None = None
    kv_events_endpoint: str | None = None

    def __post_init__(self) -> None:
        get_profile(self.profile)
        if not 0.0 <= self.global_cache_hit_threshold <= 1.0:
            raise ValueError("global cache hit threshold must be within [0, 1]")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure rate must be within [0, 1]")
        if self.time_scale < 0:
            raise ValueError("time scale must be >= 0")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block size, max-num-seqs and max-num-batched-tokens must be >= 1")

    @property
    def latency(self) -> LatencyProfile:
        return get_profile(self.profile)

    @property
    def served_model(self) -> str:
        return self.model or self.latency.model

    @property
    def kv_blocks(self) -> int:
        """KV blocks: the flag, or the profile's capacity in tokens over the block size."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, self.latency.capacity_tokens // self.block_size)
