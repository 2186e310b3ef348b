"""gateway: the front door. OpenAI-compatible REST (`http`, `openai/`) and gRPC (`grpc_api`) fronts over one
domain object (`core.Gateway`: sessions, replica choice with KV-cache affinity, failover, target-only
fallback, limits), replica pools (`routing`), metrics (`telemetry`); `python -m gateway` runs it."""
