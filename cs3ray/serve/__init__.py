"""Serving: an OpenAI-compatible Ray Serve app over a continuous-batching engine.

kv (slot KV cache) -> forward (ragged batch forward) -> engine (scheduler + sampling)
-> app (FastAPI ingress, auth, streaming) -> deploy (spec, resources, autoscaling, lifecycle)
-> launch (on which cluster: what `cs3 serve` and jobs/serve.py call).
"""
