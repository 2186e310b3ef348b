"""draft_service: the draft model's gRPC server. It runs the speculation loop per session against a verify
replica over one bidirectional stream (pipelined drafting, adaptive K) and streams committed tokens to its
caller. The drafters themselves live in the core (`specmesh.drafters`)."""
