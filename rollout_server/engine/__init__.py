"""The embedded CPU engine: a transformers model with continuous batching behind SGLang's native HTTP API.

Run it with ``python -m rollout_server.engine --model DIR --port P``; the API and its differences from
SGLang are in docs/engine.md.
"""

from core.config import SECRETS

ENGINE_KEY_ENV = SECRETS["engine.api_key"]  # the variable that hands the engine its API key
