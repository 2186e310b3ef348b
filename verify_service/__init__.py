"""verify_service: the target model's gRPC server: per-session KV caches, the batching scheduler that runs
one target forward and one rejection-sampler call per tick (the sampler lives in `specmesh.rejection`)."""
