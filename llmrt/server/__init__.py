"""The OpenAI-compatible HTTP server (`llmrt serve`).

- `protocol.py`: the request/response/chunk bodies as pydantic models (they make /openapi.json).
- `app.py`: `build_app(engine, args)`, the routes; `engine_client.py`: `EngineClient`, what they use of the engine.
- `state.py`: what the routes share (ServerState) and each request's access record.
- `requests.py`: request -> engine inputs (SamplingParams, the prompts of a completion, chat messages).
- `generation.py`: the engine streams of one API request (one per prompt), deadlines, cancellation on disconnect.
- `streaming.py`: what both endpoints share: the response head, deltas from cumulative outputs, SSE, and the
  one path to a JSON response or an event stream; `logprobs.py`: token texts and both logprobs formats.
- `completions.py`, `chat.py`: the two generation endpoints.
- `errors.py`: the one place errors become HTTP (status, OpenAI body + `retryable`, Retry-After, 400 for
  validation errors); `middleware.py`: the body cap, last-resort 500s, request ids, the JSON access log.
- `launch.py`: the serve flags and `run_server(args)`.
"""
