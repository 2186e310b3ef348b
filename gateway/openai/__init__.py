"""The OpenAI-compatible REST front, laid out as vLLM's entrypoints: `protocol` (the pydantic request and
response models, and OpenAI-shaped errors), one module per route family (`completions`, `chat`, `models`
with the model card, /version and the health checks, `tokens` with /tokenize and /detokenize), `serving` (what
those routes share) and `sse` (the server-sent events writer).
`gateway.http.create_app` assembles them into the app.
"""
