"""The ``logging:``, ``tracing:`` and ``auth:`` configuration blocks.

``logging``: ``level`` (``debug`` .. ``critical``, default ``info``), ``format``
(``text`` or ``json`` lines), ``access_log`` (one line per answered request, off by
default). The daemons' ``--log-level`` and ``--log-format`` override the first two.

``tracing``: OpenTelemetry traces, off unless ``otlp_endpoint`` is set (an OTLP/HTTP
collector: ``http://collector:4318`` gets ``/v1/traces`` appended, a URL with a
path is used as it is). ``service_name``, ``sample_ratio`` (of the traces this
gateway starts; a client's sampled ``traceparent`` is followed), ``headers`` sent
with every export (``PDO_TRACING__HEADERS='{"authorization": "..."}'`` keeps a
collector's key out of the file) and ``export_timeout`` (seconds).

``auth``: ``api_keys`` the clients must present as ``Authorization: Bearer <key>``
(``PDO_AUTH__API_KEYS='["k1", "k2"]'``); empty: no client authentication.
``/health``, ``/ready`` and ``/metrics`` stay open.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

__all__ = ["AuthConfig", "LogFormat", "LogLevel", "LoggingConfig", "TracingConfig"]

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["text", "json"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoggingConfig(_Strict):
    """How the daemon logs (see the module docstring)."""

    level: LogLevel = "info"
    format: LogFormat = "text"
    access_log: bool = False


class TracingConfig(_Strict):
    """OpenTelemetry tracing (see the module docstring)."""

    otlp_endpoint: str | None = None
    service_name: str = "pd-orchestrator"
    sample_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    headers: dict[str, str] = Field(default_factory=dict)
    export_timeout: Annotated[float, Field(gt=0.0)] = 10.0

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL with a host")
        if parts.path in ("", "/"):
            return value.rstrip("/") + "/v1/traces"
        return value

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None


class AuthConfig(_Strict):
    """API keys of the gateway itself (see the module docstring)."""

    api_keys: list[SecretStr] = Field(default_factory=list)

    @field_validator("api_keys")
    @classmethod
    def _not_blank(cls, values: list[SecretStr]) -> list[SecretStr]:
        if any(not v.get_secret_value().strip() for v in values):
            raise ValueError("an API key cannot be empty")
        return values
