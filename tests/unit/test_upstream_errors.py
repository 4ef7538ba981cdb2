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
    known_refusal,
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
            "decoder d0 refused the request during decode (HTTP 400)",
        ),
        (
            UpstreamStatusError(
                "d0", "decode", 404, "The model `x` does not exist.", role="decoder"
            ),
            404,
            "decoder d0 refused the request during decode (HTTP 404)",
        ),
        (
            UpstreamStatusError(
                "d0", "decode", 400, "The decoder prompt cannot be empty", role="decoder"
            ),
            400,
            "The decoder prompt cannot be empty",
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
        "empty-prompt",
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
    ("text", "words"),
    [
        (
            "This model's maximum context length is 32768 tokens. However, your request has "
            "40000 input tokens. Please reduce the length of the input messages.",
            "This model's maximum context length is 32768 tokens; the request has 40000 input "
            "tokens. Reduce the prompt or max_tokens.",
        ),
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
            "context length is 4096 tokens and your request has 2778 input tokens "
            "(8000 > 4096 - 2778).",
            "This model's maximum context length is 4096 tokens; the request has 2778 input "
            "tokens and asks for 8000 output tokens. Reduce the prompt or max_tokens.",
        ),
        (
            "The decoder prompt (length 12324) is longer than the maximum model length of "
            "8192. Make sure that `max_model_len` is no smaller than the number of text tokens.",
            "This model's maximum context length is 8192 tokens; the request has 12324 input "
            "tokens. Reduce the prompt or max_tokens.",
        ),
        (
            "maximum context length is 2048 tokens; see http://vllm-0.svc:8000/docs, "
            "/opt/vllm/serving.py, fe80::1 on gpu-node-7",
            "This model's maximum context length is 2048 tokens. Reduce the prompt or max_tokens.",
        ),
        ("The decoder prompt cannot be empty", "The decoder prompt cannot be empty"),
        ("The decoder prompt cannot be empty on gpu-node-7", None),
        ("maximum context length is " + "9" * 5000, None),  # no number past ten digits
        ("prompt.0: Input should be a valid integer", None),
        ("upstream fe80::1%eth0 refused", None),
        ("decode-7 (gpu-node-17) is draining", None),
        ('File "/opt/vllm/entrypoints/openai/serving.py", line 42', None),
        ("<html><body><pre>Traceback (most recent call last):</pre></body></html>", None),
    ],
    ids=[
        "input-too-long",
        "output-too-long",
        "decoder-prompt-length",
        "context-with-hosts",
        "empty-prompt",
        "empty-prompt-and-more",
        "huge-number",
        "validation",
        "ipv6",
        "host-name",
        "path",
        "html",
    ],
)
def test_known_refusals_are_rewritten_from_their_numbers(text: str, words: str | None) -> None:
    """Only a known form passes, in the gateway's words (old: any message without a
    bracketed address, URL or host:port passed as it was)."""
    assert known_refusal(text) == words
