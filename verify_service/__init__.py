"""verify_service: the target model, per-session KV caches, the batching scheduler, the rejection sampler."""
