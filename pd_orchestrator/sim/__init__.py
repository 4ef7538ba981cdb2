"""A vLLM-faithful simulator: a pure engine (:mod:`.engine`) and its HTTP front."""
