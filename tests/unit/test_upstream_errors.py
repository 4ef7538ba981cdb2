"""What a client is told about an upstream failure: the gateway's words, not the upstream's."""

from __future__ import annotations

import pytest

from pd_orchestrator.upstream.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
    client_error,
    names_an_address,
)

SECRET = "10.1.2.3:5600 said: CUDA out of memory at 0x7f"
UNKNOWN_MODEL = "The model `x` does not exist."


@pytest.mark.parametrize(
    ("error", "status", "message"),
    [
        (
            UpstreamUnavailable("d0", "decode", "Connection refused 10.1.2.3:8000", role="decoder"),
            503,
            "decoder d0 is unavailable during decode",
        ),
        (
            UpstreamUnavailable("p0", "prefill", "timed out connecting", role="prefiller"),
            502,
            "prefiller p0 is unavailable during prefill",
        ),
        (UpstreamTimeout("d0", "decode", "ReadTimedOut", role="decoder"), 504, None),
        (
            UpstreamStatusError("d0", "decode_attempt", 500, SECRET, role="decoder"),
            502,
            "decoder d0 failed during decode_attempt (HTTP 500)",
        ),
        (
            UpstreamStatusError("p0", "prefill", 503, SECRET, role="prefiller"),
            502,
            "prefiller p0 failed during prefill (HTTP 503)",
        ),
        (
            UpstreamStatusError("d0", "decode", 401, "bad api key", role="decoder"),
            502,
            "decoder d0 failed during decode (HTTP 401)",
        ),
        (
            UpstreamStatusError("d0", "decode", 400, "max_tokens is too large", role="decoder"),
            400,
            "max_tokens is too large",
        ),
        (
            UpstreamStatusError(
                "d0", "decode", 404, "The model `x` does not exist.", role="decoder"
            ),
            404,
            "The model `x` does not exist.",
        ),
        (
            UpstreamStatusError("d0", "decode", 400, f"KV pull from {SECRET}", role="decoder"),
            400,
            "decoder d0 refused the request during decode (HTTP 400)",
        ),
        (
            UpstreamProtocolError("d0", "decode", f"connection broken ({SECRET})", role="decoder"),
            502,
            "decoder d0 failed during decode",
        ),
    ],
    ids=[
        "refused",
        "prefiller-down",
        "timeout",
        "decoder-500",
        "prefiller-503",
        "upstream-401",
        "client-400",
        "client-404",
        "400-naming-a-host",
        "broken",
    ],
)
def test_client_error_uses_the_gateways_words(
    error: UpstreamError, status: int, message: str | None
) -> None:
    mapped = client_error(error)
    assert mapped.status == status
    if message is not None:
        assert mapped.message == message
    assert "10.1.2.3" not in mapped.message and "CUDA" not in mapped.message


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("This model's maximum context length is 4096 tokens.", False),
        ("prompt.0: Input should be a valid integer", False),
        ("fetch http://example.com/x failed", True),
        ("peer 192.168.0.7 refused", True),
        ("peer [fe80::1]:5600 refused", True),
        ("decode-a.internal:8000 is down", True),
    ],
)
def test_names_an_address(text: str, names: bool) -> None:
    assert names_an_address(text) is names
