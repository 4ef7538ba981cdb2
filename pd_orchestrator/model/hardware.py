"""Latency profiles of the simulator (constants from the project's calibration notes).

Time of one engine step, in seconds (``LatencyProfile.step_seconds``), a roofline::

    step    = a_dec + max(memory, compute) + load   if any request decodes in the step
            = a_pf + prefill + load                  if the step only prefills
    memory  = weights + ctx_read * (sum of the context lengths of the decoding requests)
    compute = B * lin + prefill                      for B decoding requests
    prefill = sum over prefill chunks of  n * lin + attn * n * (c + n / 2)

for a chunk of ``n`` new tokens after ``c`` already computed ones; ``load`` is the
time spent loading KV from elsewhere (a hand-over, an offload tier). A decode batch
is memory-bound (it reads the weights and its KV once per step), so a prefill chunk
small enough that ``compute`` stays below ``memory`` rides almost free on it, and a
large one makes the step compute-bound: each of its tokens then adds ``lin``
(Sarathi-Serve's observation; DistServe's stall of decodes behind a long prefill).
At the ITL table's points ``compute`` is far below ``memory``, so the fit below
still reproduces them. ``weights`` and
``ctx_read`` are fitted to the inter-token latency table (ITL at batch 1, 64 and
256 with a 2k context): ``ctx_read = (ITL256 - ITL64) / (192 * 2048)`` and
``weights = ITL1 - a_dec - 2048 * ctx_read``. A KV transfer of ``u`` tokens takes
``a_kv + u * kv_bytes_per_token / link_bytes_per_s``.

The ``instant`` profile has every constant at zero.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROFILES", "LatencyProfile", "get_profile"]


@dataclass(frozen=True, slots=True)
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

    def prefill_seconds(self, new: int, cached: int) -> float:
        """Compute time of ``new`` prompt tokens after ``cached`` ones (no fixed cost)."""
        if new <= 0:
            return 0.0
        return new * self.lin + self.attn * new * (cached + new / 2)

    def step_seconds(
        self, decode_context: int, num_decode: int, prefill: float, load: float = 0.0
    ) -> float:
        """Duration of a step with ``num_decode`` decoding requests (the roofline of the
        module docstring; pure).

        ``decode_context`` is the sum of their context lengths, ``prefill`` the summed
        :meth:`prefill_seconds` of the step's prefill chunks and ``load`` the seconds
        spent loading external KV in the step.
        """
        if num_decode == 0:
            return 0.0 if prefill == 0.0 and load == 0.0 else self.a_pf + prefill + load
        memory = self.weights + self.ctx_read * decode_context
        compute = num_decode * self.lin + prefill
        return self.a_dec + max(memory, compute) + load

    def transfer_seconds(self, tokens: int) -> float:
        """Time to move the KV of ``tokens`` tokens between instances."""
        if tokens <= 0:
            return 0.0
        return self.a_kv + tokens * self.kv_bytes_per_token / self.link_bytes_per_s


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
    itl64_ms: float,
    itl256_ms: float,
    kv_kib: int,
    capacity: int,
) -> LatencyProfile:
    ctx_read_ms = (itl256_ms - itl64_ms) / (192 * 2048)
    weights_ms = itl1_ms - a_dec_ms - 2048 * ctx_read_ms
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
            itl64_ms=11.2,
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
            itl64_ms=11.5,
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
            itl64_ms=18.8,
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
            itl64_ms=28.6,
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
