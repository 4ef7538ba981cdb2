"""Latency profiles of the simulator (constants from the project's calibration notes).

Time of one engine step, in seconds (``LatencyProfile.step_seconds``), the step as
vLLM runs it (docs/simulator-step-model.md)::

    step    = a_dec + linear + decode_attn + chunk_attn + load   if any request decodes
            = a_pf + sum over chunks of (n * lin + attn(n, c)) + load   if it only prefills
    linear  = max(weights, (B + N) * lin)      for B decoding requests and N chunk tokens
    decode_attn = ctx_read * (sum of the context lengths of the decoding requests)
    chunk_attn  = sum over prefill chunks of attn(n, c),  attn(n, c) = attn * n * (c + n / 2)

for a chunk of ``n`` new tokens after ``c`` already computed ones; ``load`` is the
time spent loading KV from elsewhere (a hand-over, an offload tier). The linear
layers (the GEMMs) are shared by every token of the step: they read the weights
once and compute over all ``B + N`` tokens, a roofline. The attention is not shared:
the decodes' attention (a KV read) and each chunk's attention run one after the
other, so neither hides behind the other's reads. A chunk thus rides free only in
the linear layers' slack, ``weights / lin - B`` tokens, which shrinks as the batch
grows (Sarathi-Serve's knee at batch 1; none left at a large batch, where every
chunk token adds ``lin``, DistServe's interference).

``weights`` and ``ctx_read`` are fitted to the ends of the inter-token latency table
(ITL at batch 1 and 256 with a 2k context; ``a_dec + linear + decode_attn`` meets
both exactly, the batch-64 point is a check). A KV transfer of ``u`` tokens takes
``a_kv + u * kv_bytes_per_token / link_bytes_per_s``.

The ``instant`` profile has every constant at zero.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from pd_orchestrator.model.records import record

__all__ = ["PROFILES", "LatencyProfile", "get_profile"]


@record
class LatencyProfile:
    """Per-instance latency constants; all times in seconds."""

    name: str
    hardware: str
    model: str
    a_pf: float
    a_dec: float
    lin: float
    attn: float
    weights: float
    ctx_read: float
    kv_bytes_per_token: int
    capacity_tokens: int
    a_kv: float = 0.001
    link_bytes_per_s: float = 40e9

    def on_clock(self, scale: float) -> LatencyProfile:
        """This profile on a clock where one of its seconds lasts ``scale`` seconds (a
        simulator run at ``--time-scale`` ``scale``, seen from outside): every time
        constant times ``scale``, the link's bandwidth divided by it."""
        if scale == 1.0:
            return self
        return replace(
            self,
            a_pf=self.a_pf * scale,
            a_dec=self.a_dec * scale,
            lin=self.lin * scale,
            attn=self.attn * scale,
            weights=self.weights * scale,
            ctx_read=self.ctx_read * scale,
            a_kv=self.a_kv * scale,
            link_bytes_per_s=self.link_bytes_per_s / scale,
        )

    def attention_seconds(self, new: int, cached: int) -> float:
        """Attention time of a prefill chunk of ``new`` tokens after ``cached`` ones."""
        if new <= 0:
            return 0.0
        return self.attn * new * (cached + new / 2)

    def prefill_seconds(self, new: int, cached: int) -> float:
        """Compute time of ``new`` prompt tokens after ``cached`` ones (no fixed cost)."""
        if new <= 0:
            return 0.0
        return new * self.lin + self.attention_seconds(new, cached)

    def step_seconds(
        self,
        decode_context: int,
        num_decode: int,
        chunks: Iterable[tuple[int, int]] = (),
        load: float = 0.0,
    ) -> float:
        """Duration of a step with ``num_decode`` decoding requests and the prefill
        ``chunks`` (the model of the module docstring; pure).

        ``decode_context`` is the sum of the decoding requests' context lengths,
        ``chunks`` the step's prefill chunks as ``(new, cached)`` token counts and
        ``load`` the seconds spent loading external KV in the step.
        """
        chunk_tokens = 0
        chunk_attention = 0.0
        for new, cached in chunks:
            chunk_tokens += max(new, 0)
            chunk_attention += self.attention_seconds(new, cached)
        if num_decode == 0:
            if chunk_tokens == 0 and load == 0.0:
                return 0.0
            return self.a_pf + chunk_tokens * self.lin + chunk_attention + load
        linear = max(self.weights, (num_decode + chunk_tokens) * self.lin)
        decode_attention = self.ctx_read * decode_context
        return self.a_dec + linear + decode_attention + chunk_attention + load

    def transfer_seconds(self, tokens: int) -> float:
        """Time to move the KV of ``tokens`` tokens between instances."""
        if tokens <= 0:
            return 0.0
        return self.a_kv + tokens * self.kv_bytes_per_token / self.link_bytes_per_s


_FIT_CONTEXT = 2048
_FIT_BATCH = 256


def _fit_decode(a_dec: float, lin: float, itl1: float, itl256: float) -> tuple[float, float]:
    """``(ctx_read, weights)`` (ms) that make ``a_dec + max(weights, B * lin) + ctx_read *
    B * 2048`` meet ``itl1`` at batch 1 and ``itl256`` at batch 256 (all in ms).

    The batch-256 step is compute-bound in its linear layers when ``256 * lin`` exceeds
    the weights read, weights-bound otherwise; the batch-1 step is weights-bound.
    """
    big = _FIT_BATCH * _FIT_CONTEXT
    ctx_read = (itl256 - a_dec - _FIT_BATCH * lin) / big
    weights = itl1 - a_dec - _FIT_CONTEXT * ctx_read
    if weights > _FIT_BATCH * lin:  # weights-bound at 256 as well
        ctx_read = (itl256 - itl1) / (big - _FIT_CONTEXT)
        weights = itl1 - a_dec - _FIT_CONTEXT * ctx_read
    return ctx_read, weights


def _fit(
    *,
    name: str,
    hardware: str,
    model: str,
    a_pf_ms: float,
    a_dec_ms: float,
    lin_us: float,
    attn_ns: float,
    itl1_ms: float,
    itl256_ms: float,
    kv_kib: int,
    capacity: int,
) -> LatencyProfile:
    ctx_read_ms, weights_ms = _fit_decode(a_dec_ms, lin_us / 1e3, itl1_ms, itl256_ms)
    return LatencyProfile(
        name=name,
        hardware=hardware,
        model=model,
        a_pf=a_pf_ms / 1e3,
        a_dec=a_dec_ms / 1e3,
        lin=lin_us / 1e6,
        attn=attn_ns / 1e9,
        weights=weights_ms / 1e3,
        ctx_read=ctx_read_ms / 1e3,
        kv_bytes_per_token=kv_kib * 1024,
        capacity_tokens=capacity,
    )


PROFILES: dict[str, LatencyProfile] = {
    p.name: p
    for p in (
        _fit(
            name="h200-llama3-8b",
            hardware="h200",
            model="meta-llama/Llama-3.1-8B-Instruct",
            a_pf_ms=8,
            a_dec_ms=2.0,
            lin_us=29.5,
            attn_ns=0.96,
            itl1_ms=6.5,
            itl256_ms=25.5,
            kv_kib=128,
            capacity=845_000,
        ),
        _fit(
            name="mi325x-llama3-8b",
            hardware="mi325x",
            model="meta-llama/Llama-3.1-8B-Instruct",
            a_pf_ms=8,
            a_dec_ms=3.0,
            lin_us=30.7,
            attn_ns=1.0,
            itl1_ms=7.2,
            itl256_ms=24.7,
            kv_kib=128,
            capacity=1_640_000,
        ),
        _fit(
            name="h200-llama3-70b-tp4",
            hardware="h200",
            model="meta-llama/Llama-3.1-70B-Instruct",
            a_pf_ms=15,
            a_dec_ms=6.0,
            lin_us=72,
            attn_ns=1.34,
            itl1_ms=15.9,
            itl256_ms=27.7,
            kv_kib=320,
            capacity=1_120_000,
        ),
        _fit(
            name="mi325x-llama3-70b-tp2",
            hardware="mi325x",
            model="meta-llama/Llama-3.1-70B-Instruct",
            a_pf_ms=15,
            a_dec_ms=5.0,
            lin_us=150,
            attn_ns=2.78,
            itl1_ms=23.2,
            itl256_ms=45.0,
            kv_kib=320,
            capacity=975_000,
        ),
        LatencyProfile(
            name="instant",
            hardware="sim",
            model="sim-model",
            a_pf=0.0,
            a_dec=0.0,
            lin=0.0,
            attn=0.0,
            weights=0.0,
            ctx_read=0.0,
            kv_bytes_per_token=128 * 1024,
            capacity_tokens=845_000,
            a_kv=0.0,
            link_bytes_per_s=float("inf"),
        ),
    )
}


def get_profile(name: str) -> LatencyProfile:
    """Return the profile called ``name``; ``KeyError`` lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown profile {name!r} (known: {known})") from None
