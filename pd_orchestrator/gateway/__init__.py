"""The gateway daemon: an OpenAI-compatible ASGI app in front of decoders and prefillers."""

from pd_orchestrator.gateway.app import Gateway

__all__ = ["Gateway"]
