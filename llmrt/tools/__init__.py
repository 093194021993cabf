"""Tools around the runtime: `llmrt regress` (safe upgrades) and `llmrt tokens` (what requests cost)."""
