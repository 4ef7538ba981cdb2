"""What routing and the policies know of an endpoint: a load reading and a candidate
(ground floor)."""

from __future__ import annotations

import math

from pd_orchestrator.model.endpoints import Endpoint, EndpointStatus
from pd_orchestrator.model.records import record

__all__ = ["Candidate", "LoadSnapshot"]


@record
class LoadSnapshot:
    """One reading of an endpoint's load (from its ``/metrics``).

    ``running`` and ``waiting`` are request counts, ``kv_usage`` the KV-cache
    usage in [0, 1], ``prefix_hit_rate`` the share of queried prompt tokens served
    from the prefix cache over the last poll window (None when unknown),
    ``preemptions`` the preemptions over that window and ``observed_at`` the
    time of the reading on the caller's clock (the one requests carry as ``now``).
    ``prefix_queries``: the prompt tokens the server has looked up in its prefix
    cache since it started (None: not exported); 0 means its cache holds nothing,
    and a drop means it restarted. ``admission_only``: the server's threshold plugin
    honours ``cache_hit_admission_only`` (it exports
    ``vllm:cache_threshold_admission_only``); ``resumes``: it advances a structured
    output's grammar over ``cache_hit_resume_tokens`` (``vllm:cache_threshold_resume``).
    ``counted``: the requests the gateways counted in flight at the endpoint while the
    reading was taken (the larger of their counts at the poll's send and at its answer;
    0 where the reader did not count them): a reading taken while a request of theirs
    ran shows it running after it has left; requests running beyond this count were
    someone else's (:attr:`Candidate.others`).
    """

    running: int
    waiting: int
    kv_usage: float
    observed_at: float
    prefix_hit_rate: float | None = None
    preemptions: int = 0
    prefix_queries: float | None = None
    admission_only: bool = False
    resumes: bool = False
    counted: int = 0

    def __post_init__(self) -> None:
        if self.running < 0 or self.waiting < 0 or self.preemptions < 0 or self.counted < 0:
            raise ValueError("request and preemption counts must be >= 0")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage {self.kv_usage} is outside [0, 1]")
        rate = self.prefix_hit_rate
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise ValueError(f"prefix_hit_rate {rate} is outside [0, 1]")
        if not math.isfinite(self.observed_at):
            raise ValueError("observed_at must be finite")

    @property
    def queue_depth(self) -> int:
        """Requests running plus waiting."""
        return self.running + self.waiting

    def age(self, now: float) -> float:
        """Seconds since the reading at ``now`` (never negative)."""
        return max(0.0, now - self.observed_at)


@record
class Candidate:
    """An endpoint a profile may choose.

    ``healthy``: the caller's verdict (health checks and load polls).
    ``in_flight``: requests the gateway itself has on the endpoint now.
    ``load``: the latest fresh reading; None when stale or never read.
    ``backlog``: prompt tokens of the gateway's requests on the endpoint that have
    not had their first answer yet (their prefill is queued or under way; a decode
    leg whose KV comes through a connector counts none).
    ``admission_only``: the endpoint's threshold plugin honours
    ``cache_hit_admission_only``, as its latest reading said -- kept while that
    reading is stale (a capability, not a load: a server too busy to answer its
    ``/metrics`` in time has not lost it). ``resumes``: likewise, its plugin
    continues a structured output over ``cache_hit_resume_tokens``.
    """

    endpoint: Endpoint
    healthy: bool = True
    in_flight: int = 0
    load: LoadSnapshot | None = None
    backlog: int = 0
    admission_only: bool = False
    resumes: bool = False

    @property
    def streams(self) -> int:
        """Requests running at the endpoint: the gateway's own count or the reading's,
        the larger."""
        load = self.load
        return max(self.in_flight, load.running if load is not None else 0)

    @property
    def others(self) -> int:
        """Requests running at the endpoint besides the gateways' own, by its reading:
        those beyond what the gateways counted there while it was taken
        (:attr:`LoadSnapshot.counted`); 0 with no reading."""
        load = self.load
        return 0 if load is None else max(load.running - load.counted, 0)

    @classmethod
    def from_status(
        cls,
        status: EndpointStatus,
        load: LoadSnapshot | None = None,
        *,
        responsive: bool = True,
        latest: LoadSnapshot | None = None,
    ) -> Candidate:
        """A candidate from a fleet snapshot; ``responsive`` is the load poller's verdict;
        the capabilities are the ``latest`` reading's, fresh or not (default: ``load``)."""
        healthy = status.healthy and responsive
        latest = load if latest is None else latest
        return cls(
            status.endpoint,
            healthy,
            status.in_flight,
            load,
            status.backlog,
            latest is not None and latest.admission_only,
            latest is not None and latest.resumes,
        )
