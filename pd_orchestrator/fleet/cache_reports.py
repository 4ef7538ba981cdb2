"""Which decoders report the cached share of a prompt.

vLLM puts ``usage.prompt_tokens_details.cached_tokens`` in its answers only when started
with ``--enable-prompt-tokens-details``, and most versions only when the count is not 0:
one answer without it is a cold prompt or a server that never says. Per endpoint::

    reporting   an answer carried the count      absent afterwards: 0 cached
    unknown     fewer than SILENT_ANSWERS answers, none with it      absent: None
    silent      SILENT_ANSWERS answers, none with it (one WARNING)   absent: None

``None`` (unknown) keeps a warm prompt from being learnt as a whole prefill: the
``goodput`` policy learns no local rate from it. Pure: no I/O but the one warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["SILENT_ANSWERS", "CacheReports", "Reporting"]

logger = logging.getLogger(__name__)

Reporting = Literal["reporting", "unknown", "silent"]

SILENT_ANSWERS = 16
"""Answers without a cached count after which an endpoint is taken not to report it:
with prefix caching, sixteen prompts (a chat template's shared system prompt is
enough) almost always include a cache hit on a server that reports them."""

FLAG = "--enable-prompt-tokens-details"
"""The vLLM flag that makes a server report its cached count."""


@dataclass
class CacheReports:
    """Per endpoint name: whether it reports cached counts (module docstring)."""

    silent_after: int = SILENT_ANSWERS
    _seen: dict[str, int] = field(default_factory=dict)
    _reporting: set[str] = field(default_factory=set)

    def resolve(self, endpoint: str, cached: int | None) -> int | None:
        """The cached count of one answer of ``endpoint`` that reported ``cached``
        (None: no ``prompt_tokens_details``): ``cached`` when reported, 0 when absent
        at an endpoint that reports, else None (unknown). Warns once, naming the flag,
        when ``endpoint`` turns silent."""
        if cached is not None:
            self._reporting.add(endpoint)
            return cached
        if endpoint in self._reporting:
            return 0
        seen = self._seen.get(endpoint, 0) + 1
        self._seen[endpoint] = seen
        if seen == self.silent_after:
            logger.warning(
                "endpoint %s answered %d prompts without prompt_tokens_details: its cached "
                "counts are unknown, so no local prefill rate is learnt from it; start "
                "vLLM with %s",
                endpoint,
                seen,
                FLAG,
            )
        return None

    def state(self, endpoint: str) -> Reporting:
        """Whether ``endpoint`` reports its cached counts (module docstring)."""
        if endpoint in self._reporting:
            return "reporting"
        return "silent" if self._seen.get(endpoint, 0) >= self.silent_after else "unknown"

    def inherit(self, previous: CacheReports) -> None:
        """Keep what ``previous`` (a configuration before a reload) learnt."""
        self._seen.update(previous._seen)
        self._reporting |= previous._reporting
