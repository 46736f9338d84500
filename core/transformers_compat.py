"""The name a causal LM's forward gives its KV cache: ``cache`` from transformers 5.24 (``past_key_values``, the
name before it, is removed in 5.40). The CPU install takes the newest transformers while SGLang's GPU image pins
5.19, so the engine and the trainer pass the cache, and read it back, under ``CACHE_ARG``."""

from __future__ import annotations

import transformers
from packaging.version import Version

CACHE_ARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"
