"""The ``prefix:`` configuration block: the shared state of prefix-aware routing.

The prefix scorers themselves (``precise-prefix``, ``approximate-prefix``,
``prefix-affinity``) are configured in the ``routing:`` profiles; this block holds
what they share: the adapters that separate prefix caches and the precise index
fed by the servers' KV events. The YAML::

    prefix:
      lora_adapters:                   # adapter name -> path, as the servers load them
        sql: /adapters/sql             # (vLLM keys an adapter's blocks by both)
      precise:                         # omit to run without the precise index
        block_size: 16                 # the servers' --block-size
        hash_algo: sha256              # the servers' --prefix-caching-hash-algo
        hash_seed: null                # the servers' PYTHONHASHSEED; null: unset
        media: [GPU]                   # KV-event media that count as cached
        capacity_per_endpoint: 262144  # index entries kept per endpoint
        max_request_blocks: 8192       # leading blocks of a prompt hashed
        tokenize: false                # tokenize text prompts through /tokenize
        tokenize_timeout: 1.0          # seconds; on expiry the request has no tokens
        events:
          publisher: "tcp://{host}:5557"   # template for every endpoint; null: none
          replay: null                     # e.g. "tcp://{host}:5558"
          topic: ""                        # subscription prefix ("": all)
          heartbeat: 1.0                   # seconds; 3 silent intervals = lost
          replay_timeout: 2.0              # seconds to wait for each replayed batch
          endpoints:                       # per endpoint name; overrides the templates
            decode-0: {publisher: "tcp://10.0.0.5:5557", replay: "tcp://10.0.0.5:5558"}

Templates take ``{host}`` (the endpoint URL's host) and ``{name}``. Each server
needs ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` and the same
block size, hash algorithm and ``PYTHONHASHSEED`` as configured here.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pd_orchestrator.model.hashing import HashAlgo

__all__ = ["EventsConfig", "PreciseConfig", "PrefixConfig", "SourceConfig"]

Seconds = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1)]
_PLACEHOLDERS = {"host": "h", "name": "n"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _zmq_template(value: str | None) -> str | None:
    if value is None:
        return None
    if not value.startswith(("tcp://", "ipc://")):
        raise ValueError(f"{value!r} is not a tcp:// or ipc:// ZMQ endpoint")
    try:
        value.format(**_PLACEHOLDERS)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"{value!r}: only {{host}} and {{name}} may be used ({exc})") from None
    return value


class SourceConfig(_Strict):
    """One endpoint's KV-event sockets (``{host}`` and ``{name}`` work here too)."""

    publisher: str
    replay: str | None = None

    _check = field_validator("publisher", "replay")(_zmq_template)


class EventsConfig(_Strict):
    """Where the KV events come from; see the module docstring."""

    publisher: str | None = "tcp://{host}:5557"
    replay: str | None = None
    topic: str = ""
    heartbeat: Seconds = 1.0
    replay_timeout: Seconds = 2.0
    endpoints: dict[str, SourceConfig] = Field(default_factory=dict)

    _check = field_validator("publisher", "replay")(_zmq_template)


class PreciseConfig(_Strict):
    """The precise index and how requests are hashed; see the module docstring."""

    block_size: Count = 16
    hash_algo: HashAlgo = "sha256"
    hash_seed: str | None = None
    media: Annotated[list[str], Field(min_length=1)] = Field(default_factory=lambda: ["GPU"])
    capacity_per_endpoint: Count = 262_144
    max_request_blocks: Count = 8192
    tokenize: bool = False
    tokenize_timeout: Seconds = 1.0
    events: EventsConfig = Field(default_factory=EventsConfig)


class PrefixConfig(_Strict):
    """``lora_adapters`` (name -> path) and the optional ``precise`` index."""

    lora_adapters: dict[str, str] = Field(default_factory=dict)
    precise: PreciseConfig | None = None
