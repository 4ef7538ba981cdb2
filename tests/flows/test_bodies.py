"""Leg bodies encoded once per request: the client's large values shared by every leg."""

from __future__ import annotations

import tracemalloc
from typing import Any

import orjson

from pd_orchestrator.flows.bodies import SharedEncoding, leg_body, with_threshold
from pd_orchestrator.flows.choices import choice_request
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.openai.protocol import parse_for
from pd_orchestrator.upstream.transport import Origin, Request

MIB = 1 << 20


def _request(body: dict[str, Any]) -> ClientRequest:
    return ClientRequest("chat", "/v1/chat/completions", body, parse_for("chat", body), "r", 0.0)


def _legs(request: ClientRequest, n: int) -> list[dict[str, Any]]:
    """Each choice's attempt, prefill and decode leg bodies."""
    bodies = []
    for index in range(n):
        choice = choice_request(request, index)
        attempt = leg_body(choice, 0.5, stream=True)
        prefill = {**with_threshold(attempt, 0.0), "max_tokens": 1, "kv_transfer_params": {}}
        bodies += [attempt, prefill, with_threshold(attempt, 0.0)]
    return bodies


def test_legs_encode_as_the_body_and_share_the_large_values() -> None:
    messages = [{"role": "user", "content": "x" * 50_000}, {"role": "user", "content": "hi"}]
    body = {"model": "m", "messages": messages, "n": 16, "seed": 3, "tools": [{"a": 1}]}
    request = _request(body)
    encoding = SharedEncoding(request.body)
    encoded = [encoding.encode(leg) for leg in _legs(request, 16)]
    for leg, pieces in zip(_legs(request, 16), encoded, strict=True):
        assert orjson.loads(b"".join(pieces)) == leg
    large = {id(piece) for pieces in encoded for piece in pieces if len(piece) > 50_000}
    assert len(large) == 1  # one encoding of the messages, shared by all 48 legs
    small = SharedEncoding({"model": "m", "prompt": "short"}).encode({"prompt": "short"})
    assert small == (b'{"prompt":"short"}',)
    assert SharedEncoding(body).encode({"messages": messages})[0] == b"{"  # no own field


def test_a_string_is_shared_by_its_encoded_size_not_its_length() -> None:
    escaped, plain = "\x01" * 11, "a" * 11  # 68 and 13 bytes in JSON, 11 characters each
    body = {"model": "m", "prompt": escaped, "suffix": plain}
    pieces = SharedEncoding(body, least=64).encode(dict(body))
    assert pieces[0] == b'{"model":"m","suffix":"aaaaaaaaaaa",'
    assert pieces[1:] == (b'"prompt":', orjson.dumps(escaped), b"}")
    assert orjson.loads(b"".join(pieces)) == body


def test_the_transport_writes_a_shared_piece_as_it_is() -> None:
    shared = b'"prompt":"' + b"x" * 100_000 + b'"'
    request = Request("POST", Origin.of("http://d0"), "/v1/completions", (b'{"n":1,', shared, b"}"))
    pieces = request.encode()
    assert any(piece is shared for piece in pieces)
    head = pieces[0]
    assert b"content-length: %d\r\n" % (len(shared) + 8) in head
    assert request.json() == {"n": 1, "prompt": "x" * 100_000}
    whole = Request("POST", Origin.of("http://d0"), "/", b'{"n":1}').encode()
    assert len(whole) == 1 and whole[0].endswith(b'\r\n\r\n{"n":1}')


def test_sixteen_choices_of_a_large_body_hold_one_copy_of_it() -> None:
    """48 legs of a 1 MiB prompt, encoded and made requests, hold one copy of its bytes
    (old: each leg's body was encoded whole, then joined with its head: 96 copies)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * MIB}], "n": 16}
    request = _request(body)
    legs = _legs(request, 16)
    tracemalloc.start()
    try:
        encoding = SharedEncoding(request.body)
        origin = Origin.of("http://d0")
        sent = [
            Request("POST", origin, "/v1/completions", encoding.encode(leg)).encode()
            for leg in legs
        ]
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert len(sent) == 48
    copies = [trace for trace in snapshot.traces if trace.size >= MIB]
    assert len(copies) == 1
