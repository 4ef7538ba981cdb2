"""pd-orchestrator: a decode-first prefill/decode disaggregation orchestrator for vLLM."""

__version__ = "0.1.0"

__all__ = ["__version__"]
