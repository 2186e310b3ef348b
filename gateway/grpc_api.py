"""specmesh.v1.GatewayService over gRPC: protobuf <-> the gateway's domain object (core.py).

Bad input is INVALID_ARGUMENT, never INTERNAL: a request that does not parse (a string that is not UTF-8)
reaches the servicer as None (see gateway.server), texts are measured before they are tokenized, and the
session id and prefix-cache scope sent downstream are scoped to the caller's API key and cache_salt
(gateway.tenancy).
"""

from __future__ import annotations

import contextlib

from gateway.core import Gateway, GenRequest, Outcome, shown, speculative_decoding
from gateway.tenancy import downstream_session_id, prefix_scope, tenant_of
from specmesh import wire
from specmesh.domain import TokenLogprob
from specmesh.errors import InvalidArgument, NotFound
from specmesh.v1 import gateway_pb2, gateway_pb2_grpc

Chunk = gateway_pb2.GatewayServiceGenerateStreamResponse
SESSION_ID_MAX = 256  # characters of a session_id or cache_salt, as on the REST front
# The roles the REST chat route takes; "developer" is OpenAI's newer name for "system".
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _authorization(context) -> str | bytes | None:
    """The call's `authorization` metadata when sent once (the key check refuses it sent several times)."""
    values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
    return values[0] if len(values) == 1 else None


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway, keyed_tenants: bool = False):
        self.gateway = gateway
        self.keyed_tenants = keyed_tenants  # API keys are checked: each key is a tenant of its own

    async def _request(self, request, context) -> GenRequest:
        if request is None:
            raise InvalidArgument("the request does not parse as its message (strings must be valid UTF-8)")
        if request.model and request.model != self.gateway.config.model_name:
            raise NotFound(
                f"the model {shown(request.model)} does not exist; this gateway serves "
                f"{shown(self.gateway.config.model_name)}"
            )
        for name in ("session_id", "cache_salt"):
            if len(getattr(request, name)) > SESSION_ID_MAX:
                raise InvalidArgument(f"{name} must be at most {SESSION_ID_MAX} characters")
        if sum(map(bool, (request.prompt, request.prompt_ids, request.messages))) != 1:
            raise InvalidArgument("give exactly one of prompt (text), prompt_ids and messages")
        if request.messages:
            ids = await self.gateway.tokenize_chat([self._message(i, m) for i, m in enumerate(request.messages)])
        else:
            ids = list(request.prompt_ids) or await self.gateway.tokenize(request.prompt)
        tenant = tenant_of(_authorization(context), self.keyed_tenants)
        session_id = downstream_session_id(tenant, request.cache_salt, request.session_id)
        return GenRequest(
            ids,
            wire.params_from_pb(request.params),
            session_id,
            wire.spec_len_from_pb(request),
            cache_scope=prefix_scope(tenant, request.cache_salt),
        )

    @staticmethod
    def _message(i: int, message) -> dict:
        """A chat message as the chat template takes it (the REST chat route's shape)."""
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {message.role!r}")
        return {"role": CHAT_ROLES[message.role], "content": message.content}

    def _speculative_decoding(self, outcome: Outcome) -> gateway_pb2.SpeculativeDecodingMetrics | None:
        """vLLM's per-request metrics of the generation, as the REST front's (None: not reported)."""
        config = self.gateway.config
        if config.per_request_spec_decode_metrics == "none" or not config.draft:
            return None
        spec = speculative_decoding(outcome.stats, config.per_request_spec_decode_metrics == "detailed")
        by_length = spec.pop("acceptance_histogram_by_draft_length")
        pb = gateway_pb2.SpeculativeDecodingMetrics(**{k: v for k, v in spec.items() if v is not None})
        for k, counts in by_length.items():
            pb.acceptance_histogram_by_draft_length[k].rounds.extend(counts)
        return pb

    def _final(self, request, outcome: Outcome, finish) -> dict:
        return dict(
            speculative_decoding=self._speculative_decoding(outcome),
            session_id=request.session_id,
            finish_reason=wire.finish_to_pb(finish),
            usage=gateway_pb2.Usage(
                prompt_tokens=outcome.prompt_tokens,
                completion_tokens=outcome.completion_tokens,
                cached_prompt_tokens=outcome.cached_prompt_tokens,
            ),
            stats=wire.stats_to_pb(outcome.stats),
            failovers=outcome.failovers,
            target_only=outcome.target_only,
            handed_off=outcome.handed_off,
        )

    async def Generate(self, request, context):
        req = await self._request(request, context)
        outcome = Outcome(prompt_tokens=len(req.prompt_ids))
        text: list[str] = []
        ids: list[int] = []
        finish: str | None = None
        logprobs: list[TokenLogprob] = []
        async with contextlib.aclosing(self.gateway.generate(req, outcome)) as chunks:
            async for chunk in chunks:
                text.append(chunk.text)
                ids += chunk.token_ids
                logprobs += chunk.logprobs or []
                finish = chunk.finish_reason or finish
        return gateway_pb2.GatewayServiceGenerateResponse(
            text="".join(text),
            token_ids=ids,
            logprobs=wire.logprobs_to_pb(logprobs),
            **self._final(request, outcome, finish),
        )

    async def GenerateStream(self, request, context):
        req = await self._request(request, context)
        outcome = Outcome(prompt_tokens=len(req.prompt_ids))
        async with contextlib.aclosing(self.gateway.generate(req, outcome)) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason is None:
                    logprobs = wire.logprobs_to_pb(chunk.logprobs)
                    yield Chunk(delta=Chunk.Delta(text=chunk.text, token_ids=chunk.token_ids, logprobs=logprobs))
                else:
                    yield Chunk(
                        finished=Chunk.Finished(
                            text=chunk.text,
                            token_ids=chunk.token_ids,
                            logprobs=wire.logprobs_to_pb(chunk.logprobs),
                            **self._final(request, outcome, chunk.finish_reason),
                        )
                    )
