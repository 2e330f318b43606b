"""Attention over the paged KV cache: the cache and its writes (``pages``), the seam the model
calls (``base``: ``AttentionBackend``, ``StepMeta``) and its backends (``xla``, ``cpu``)."""
