"""specmesh.v1.GatewayService over gRPC: protobuf <-> the gateway's domain object (core.py)."""

from __future__ import annotations

from gateway.core import Gateway, GenRequest, Outcome
from specmesh import wire
from specmesh.errors import InvalidArgument, NotFound
from specmesh.v1 import gateway_pb2, gateway_pb2_grpc

Chunk = gateway_pb2.GatewayServiceGenerateStreamResponse
# The roles the REST chat route takes; "developer" is OpenAI's newer name for "system".
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def _request(self, request) -> GenRequest:
        if request.model and request.model != self.gateway.config.model_name:
            raise NotFound(
                f"the model {request.model!r} does not exist; this gateway serves {self.gateway.config.model_name!r}"
            )
        if sum(map(bool, (request.prompt, request.prompt_ids, request.messages))) != 1:
            raise InvalidArgument("give exactly one of prompt (text), prompt_ids and messages")
        if request.messages:
            ids = self.gateway.chat_prompt([self._message(i, m) for i, m in enumerate(request.messages)])
        else:
            ids = list(request.prompt_ids) or self.gateway.encode(request.prompt)
        return GenRequest(ids, wire.params_from_pb(request.params), request.session_id, wire.spec_len_from_pb(request))

    @staticmethod
    def _message(i: int, message) -> dict:
        """A chat message as the chat template takes it (the REST chat route's shape)."""
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {message.role!r}")
        return {"role": CHAT_ROLES[message.role], "content": message.content}

    @staticmethod
    def _final(request, outcome: Outcome, finish) -> dict:
        return dict(
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
        )

    async def Generate(self, request, context):
        req = self._request(request)
        outcome = Outcome(prompt_tokens=len(req.prompt_ids))
        text, ids, finish, logprobs = [], [], None, []
        async for chunk in self.gateway.generate(req, outcome):
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
        req = self._request(request)
        outcome = Outcome(prompt_tokens=len(req.prompt_ids))
        async for chunk in self.gateway.generate(req, outcome):
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
