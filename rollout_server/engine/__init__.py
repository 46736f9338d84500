"""The embedded CPU engine: a transformers model with continuous batching behind SGLang's native HTTP API.

Run it with ``python -m rollout_server.engine --model DIR --port P``; the API and its differences from
SGLang are in docs/engine.md.
"""
