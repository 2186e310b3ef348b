"""draft_service: the draft model's gRPC server (issue 4).

Its domain logic — the model drafter and the n-gram drafter — lives in `specmesh.drafting` and already
serves the in-process engine; the server that streams draft blocks to a verify replica lands with the
service-pair issue.
"""
