"""SGLang's native HTTP API (`POST /generate`, `/get_model_info`, `/server_info`, `/flush_cache`,
`/health_generate`) on the gateway, so SGLang's frontend language and tools run against specmesh unchanged."""

from gateway.sglang.serving import router

__all__ = ["router"]
