"""gateway: OpenAI-compatible REST and gRPC fronts, sessions and KV-cache affinity (issue 5; not built yet)."""
