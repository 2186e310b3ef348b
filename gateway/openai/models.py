"""GET /v1/models (the one model this gateway serves), /health (readiness: 503 while no verify replica is
healthy) and /health/live (liveness: the process answers)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.openai.protocol import Health, ModelCard, ModelList
from gateway.openai.serving import Front


def router(front: Front) -> APIRouter:
    api = APIRouter()

    @api.get("/health")
    async def health() -> JSONResponse:
        v, d = len(front.gateway.verify_pool.healthy), len(front.gateway.draft_pool.healthy)
        ok = v > 0
        body = Health(
            status="ok" if ok else "unavailable", verify_healthy=v, draft_healthy=d, target_only=ok and d == 0
        )
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    @api.get("/health/live")
    async def live() -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(request: Request) -> dict:
        front.authorize(request)
        return ModelList(data=[ModelCard(id=front.model_name, created=front.created)]).model_dump()

    return api
