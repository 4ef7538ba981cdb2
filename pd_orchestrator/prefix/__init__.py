"""Prefix-aware routing state: vLLM-compatible block hashing, the KV-event wire
format, the precise index fed by KV events, the approximate character-chunk cache
and the affinity prefix tree. Everything here is pure except :mod:`.runtime`."""
