"""The OpenAI-compatible HTTP server (`llmrt serve`).

- `protocol.py`: the request/response/chunk bodies as pydantic models (they make /openapi.json).
- `app.py`: `build_app(engine, args)`, the routes.
- `serving.py`: completions and chat over AsyncLLM: SamplingParams from a request, one engine request per prompt,
  responses and SSE deltas from cumulative outputs, cancellation when the client leaves, logprobs formats.
- `errors.py`: the one place errors become HTTP (status, OpenAI body + `retryable`, Retry-After, 400 for
  validation errors); `middleware.py`: the 10 MB body cap, last-resort 500s, request ids, the JSON access log.
- `launch.py`: the serve flags and `run_server(args)`.
"""
