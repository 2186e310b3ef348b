"""The OpenAI-compatible REST front, laid out as vLLM's entrypoints: `protocol` (the pydantic request and
response models, and OpenAI-shaped errors), one module per route family (`completions`, `chat`, `models`
with the health checks), `serving` (what those routes share) and `sse` (the server-sent events writer).
`gateway.http.create_app` assembles them into the app.
"""
