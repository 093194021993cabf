"""A router over many llmrt instances: policies, versions and canaries, health and ejection, safe retries.

Modules: backends (instances, health checks, ejection), policies (round-robin, least-load, prefix-affinity,
session), prompts (what is read of a body), versions (pins, canaries), retry (what is retried, the budget),
proxy (the relay), metrics, app (the ASGI app), instances (--launch), launch (`llmrt route`).
"""
