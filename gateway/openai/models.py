"""GET /v1/models and /v1/models/{id} (the one model this gateway serves, in vLLM's model card: `root`,
`parent`, `max_model_len`, `permission`), GET /version, /health (readiness: 503 while no verify replica is
healthy) and /health/live (liveness: the process answers).

The card's `root` (the checkpoint served) and `max_model_len` come from the verify replicas' Info, asked
lazily and kept for a while (`ModelLimits`): the smallest context of the healthy replicas, and never more
than the gateway itself admits (longest prompt + largest max_tokens). With no verify replica answering,
the card falls back to the gateway's own limits and its served name.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Literal

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import specmesh
from gateway.core import Gateway
from gateway.openai import protocol
from gateway.openai.protocol import APIError, Health
from gateway.openai.serving import Front
from specmesh.v1 import verify_pb2, verify_pb2_grpc

log = logging.getLogger("specmesh.gateway.models")

INFO_TIMEOUT_S = 2.0
INFO_TTL_S = 30.0  # replicas come and go (and may be reconfigured): the card follows within this
INFO_RETRY_S = 2.0  # after no replica answered


class ModelPermission(BaseModel):
    """vLLM's (and OpenAI's former) permission object: what may be done with the model."""

    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(protocol.ModelCard):
    """OpenAI's model object with vLLM's additions."""

    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@dataclass
class ModelLimits:
    """What the verify replicas say of the model they serve (`root`, `max_model_len`), asked at most once
    per INFO_TTL_S, by one caller at a time."""

    gateway: Gateway
    root: str = ""
    max_context: int = 0  # 0: no replica has answered yet
    asked_at: float = float("-inf")
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def gateway_limit(self) -> int:
        """The most tokens one generation may span through this gateway: longest prompt + largest output."""
        c = self.gateway.config
        return c.max_prompt_tokens + c.max_tokens_limit

    @property
    def max_model_len(self) -> int:
        return min(self.max_context, self.gateway_limit) if self.max_context else self.gateway_limit

    async def refresh(self) -> None:
        async with self.lock:
            if time.monotonic() - self.asked_at < INFO_TTL_S:
                return
            pool = self.gateway.verify_pool
            replies = await asyncio.gather(*(self._info(pool, r) for r in pool.healthy))
            answered = [r for r in replies if r is not None]
            if answered:
                self.max_context = min(r.max_context_length for r in answered)
                self.root = answered[0].model_path
                self.asked_at = time.monotonic()
            else:  # answer with the gateway's limits meanwhile, and ask again soon
                self.asked_at = time.monotonic() - INFO_TTL_S + INFO_RETRY_S

    @staticmethod
    async def _info(pool, replica) -> verify_pb2.VerifyServiceInfoResponse | None:
        try:
            stub = verify_pb2_grpc.VerifyServiceStub(pool.channel(replica))
            return await stub.Info(verify_pb2.VerifyServiceInfoRequest(), timeout=INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("verify replica %s did not answer Info: %s", replica.address, e.code().name)
            return None
        except Exception:  # best effort: the card is answered from the gateway's limits whatever went wrong
            log.warning("asking verify replica %s for Info failed", replica.address, exc_info=True)
            return None


# One per gateway, shared by the routers of one app (models and tokenize both report max_model_len).
_LIMITS: weakref.WeakKeyDictionary[Gateway, ModelLimits] = weakref.WeakKeyDictionary()


async def model_limits(gateway: Gateway) -> ModelLimits:
    limits = _LIMITS.get(gateway)
    if limits is None:
        limits = _LIMITS[gateway] = ModelLimits(gateway)
    await limits.refresh()
    return limits


async def model_card(front: Front) -> ModelCard:
    limits = await model_limits(front.gateway)
    return ModelCard(
        id=front.model_name,
        created=front.created,
        root=limits.root or front.model_name,
        max_model_len=limits.max_model_len,
        permission=[ModelPermission(id=f"modelperm-{uuid.uuid4().hex}", created=front.created)],
    )


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

    @api.get("/version")
    async def version() -> dict:
        return {"version": specmesh.__version__}

    @api.get("/v1/models")
    async def models(request: Request) -> dict:
        front.authorize(request)
        return ModelList(data=[await model_card(front)]).model_dump()

    # `:path`: a served name may contain slashes ("org/model"), as the client sends it unescaped
    @api.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict:
        front.authorize(request)
        if model_id != front.model_name:
            raise APIError(
                404,
                f"the model '{model_id}' does not exist; this gateway serves '{front.model_name}'",
                "model",
                "model_not_found",
            )
        return (await model_card(front)).model_dump()

    return api
