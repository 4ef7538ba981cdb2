"""What a client body's parse and validation cost per request: pydantic against msgspec.

The gateway decodes each client body once (orjson, to a dict it forwards upstream
with its unknown fields) and validates it once (pydantic, the models of
:mod:`pd_orchestrator.openai.protocol`). This times, in one invocation and on the same
bodies, that path against the two ways msgspec could take it:

- ``pydantic``: :func:`~pd_orchestrator.openai.protocol.decode_json_object` then
  :func:`~pd_orchestrator.openai.protocol.parse_for` (what the gateway runs);
- ``msgspec convert``: the same orjson dict, validated by ``msgspec.convert`` into
  structs with the same fields and bounds (the dict is still forwarded);
- ``msgspec decode``: ``msgspec.json.decode`` straight into the structs, plus the
  orjson dict the gateway forwards (structs drop unknown fields);
- ``orjson alone``: the dict only, the floor of any validation.

Bodies: the overhead benchmark's request (a short prompt, ``max_tokens`` 16), the
same streamed with the usage chunk, a chat request of four messages, and a prompt of
2,048 token ids. It prints each path's median microseconds per body and the saving
against ``pydantic``; set them against the gateway's CPU per request in
benchmarks/README.md ("Overhead").

    .venv/bin/python benchmarks/parse_bench.py [--repeats 15] [--loops 2000]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, Literal

import msgspec
import orjson

from pd_orchestrator.openai.protocol import MAX_CHOICES, decode_json_object, parse_for
from pd_orchestrator.vllm_plugin.policy import parse_count, parse_flag

Kind = Literal["completion", "chat"]


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    """The fields and bounds of ``_CommonRequest``, as msgspec states them."""

    model: str
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    ignore_eos: bool = False
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    cache_hit_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    cache_hit_admission_only: Any = None
    cache_hit_resume_tokens: Any = None

    def __post_init__(self) -> None:
        self.cache_hit_admission_only = parse_flag(
            self.cache_hit_admission_only, "cache_hit_admission_only"
        )
        self.cache_hit_resume_tokens = parse_count(
            self.cache_hit_resume_tokens, "cache_hit_resume_tokens"
        )


class _Completion(_Common, kw_only=True):
    prompt: str | list[int]


class _TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class _Message(msgspec.Struct):
    role: str
    content: str | list[_TextPart] | None = None


class _Chat(_Common, kw_only=True):
    messages: Annotated[list[_Message], msgspec.Meta(min_length=1)]
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    add_generation_prompt: bool = True


_STRUCTS: dict[Kind, type[_Common]] = {"completion": _Completion, "chat": _Chat}
_DECODERS = {kind: msgspec.json.Decoder(struct) for kind, struct in _STRUCTS.items()}


def bodies() -> dict[str, tuple[Kind, bytes]]:
    """Each body by name: its route and its bytes."""
    short = {"model": "m", "prompt": "Say something short.", "max_tokens": 16}
    streamed = {**short, "stream": True, "stream_options": {"include_usage": True}}
    chat = {
        "model": "m",
        "max_tokens": 64,
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is disaggregated serving?"},
            {"role": "assistant", "content": "Prefill and decode on separate instances."},
            {"role": "user", "content": "And when does it pay?"},
        ],
    }
    ids = {"model": "m", "prompt": [(7 * i) % 32000 for i in range(2048)], "max_tokens": 16}
    named = {"whole": short, "stream": streamed, "chat": chat, "2048 ids": ids}
    return {
        name: ("chat" if "messages" in body else "completion", orjson.dumps(body))
        for name, body in named.items()
    }


def paths(kind: Kind) -> dict[str, Callable[[bytes], object]]:
    """Each way to take a body of ``kind``: a function of its bytes."""
    struct, decoder = _STRUCTS[kind], _DECODERS[kind]

    def current(raw: bytes) -> object:
        return parse_for(kind, decode_json_object(raw))

    def convert(raw: bytes) -> object:
        return msgspec.convert(orjson.loads(raw), struct)

    def decode(raw: bytes) -> object:
        return decoder.decode(raw), orjson.loads(raw)

    return {
        "pydantic": current,
        "msgspec convert": convert,
        "msgspec decode": decode,
        "orjson alone": orjson.loads,
    }


def per_call_us(work: Callable[[bytes], object], raw: bytes, repeats: int, loops: int) -> float:
    """Median over ``repeats`` of the mean microseconds of ``loops`` calls (the garbage
    collector on, as in the gateway)."""
    runs = timeit.repeat(partial(work, raw), "gc.enable()", number=loops, repeat=repeats)
    return statistics.median(runs) / loops * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--loops", type=int, default=2000)
    args = parser.parse_args()
    print(f"us per body, median of {args.repeats} x {args.loops} (msgspec {msgspec.__version__})")
    for name, (kind, raw) in bodies().items():
        ways = paths(kind)
        for way in ways.values():  # each must accept the body before it is timed
            way(raw)
        times = {
            way: per_call_us(work, raw, args.repeats, args.loops) for way, work in ways.items()
        }
        base = times["pydantic"]
        cells = ", ".join(
            f"{way} {us:.2f}" + ("" if way == "pydantic" else f" (saves {base - us:.2f})")
            for way, us in times.items()
        )
        print(f"{name} ({len(raw):,} bytes): {cells}")


if __name__ == "__main__":
    main()
