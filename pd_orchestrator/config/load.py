"""The ``load:`` configuration block: how each endpoint's ``/metrics`` is polled."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["LoadConfig"]

Seconds = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class LoadConfig(BaseModel):
    """Load polling of every endpoint (``GET /metrics``, vLLM's Prometheus text).

    ``interval``: seconds between two polls of the fleet (default 1).
    ``timeout``: seconds one poll may take (default 2; a busy vLLM answers slowly).
    ``stale_after``: a reading older than this many seconds counts as absent
    (default 5; at least ``interval``).
    ``unhealthy_after``: failed polls in a row that mark an endpoint unresponsive
    (default 5); one successful poll marks it responsive again.
    ``hit_rate_tokens``: the prompt tokens an endpoint's prefix hit rate is read over
    at least: its window reaches back over the last polls at which it was queried
    until they add up to this many (default 65,536, about sixteen 4k prompts; 0: the
    window since the last such poll).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval: Seconds = 1.0
    timeout: Seconds = 2.0
    stale_after: Seconds = 5.0
    unhealthy_after: Annotated[int, Field(ge=1)] = 5
    hit_rate_tokens: Annotated[int, Field(ge=0)] = 65_536

    @model_validator(mode="after")
    def _stale_after_a_poll(self) -> Self:
        if self.stale_after < self.interval:
            raise ValueError(
                f"stale_after ({self.stale_after}s) must be at least interval "
                f"({self.interval}s), or every reading is stale before the next poll"
            )
        return self
