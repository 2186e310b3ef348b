"""The draft service's domain object: batched drafting for every session, the speculation loop per session,
and the remote verifiers they talk to. No servicer code here (see servicer.py).

Everything but the model runs on the event loop: each Generate runs `specmesh.loop.speculative_generate`
(the same loop as in-process generation) as a coroutine, with a `RemoteVerifier` for the named verify
replica, pipelined drafting and goodput-driven K. Every session's draft tokens come from one
`DraftBatcher` whose forwards run on the single model thread, so each draft forward advances every session
that is drafting, including those drafting ahead while their block is verified. The verify service is
authoritative for stop conditions (EOS, stop strings): its verdicts carry the finish reason, and the loop
here applies only the rules both sides compute identically (max_tokens, stop token ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import grpc
import torch
from opentelemetry import context as otel_context

from draft_service.online import OnlineLoop, online_config
from draft_service.remote import RemoteVerifier
from specmesh import config as flags
from specmesh import wire
from specmesh.domain import Finished, GenerationEvent, Opened, SpecStats, Tokens
from specmesh.drafters import (
    ALGORITHMS,
    Algorithm,
    DraftBatcher,
    HybridChooser,
    HybridDrafter,
    ModelDrafter,
    SuffixCache,
    SuffixDrafter,
    SuffixParams,
    make_drafter,
)
from specmesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from specmesh.loop import Drafter, FixedK, GoodputGuards, GoodputK, RoundRecord, speculative_generate
from specmesh.models import load_model
from specmesh.rejection import MAX_SPEC_LEN
from specmesh.runtime import Runner
from specmesh.runtime.attention import ATTENTION_BACKENDS, check_attention_backend
from specmesh.runtime.registry import KINDS, batched_supported, build_runner
from specmesh.sampling import SamplingParams, StopChecker, check_token_ids
from specmesh.security import AllowList, Security, dial
from specmesh.telemetry import StreamMetrics, outgoing_metadata, tracer, wall_ns
from specmesh.training.online import OnlineConfig
from specmesh.v1 import verify_pb2, verify_pb2_grpc

log = logging.getLogger("specmesh.draft")
RUNNERS = KINDS  # --draft-runner: specmesh.runtime.registry's kinds
DRAFT_BLOCK_SIZE = 16  # the paged draft runner's KV block (tokens)


@dataclass(frozen=True)
class DraftConfig:
    """The draft service's settings; each field declared with `option` is also its flag (`python -m
    draft_service --help`)."""

    model_path: str = flags.option("", "local HF checkpoint directory of the draft model (standalone)")
    host: str = flags.host_option()
    port: int = flags.grpc_port_option(50062)
    device: str | None = flags.device_option()
    dtype: str = flags.dtype_option(draft=True)
    verify_address: str = flags.option("", "default verify replica host:port (a request may name another)")
    # A caller chooses among the replicas the operator configured, never an address of its own.
    verify_allow: str = flags.option(
        "",
        "verify replicas a request's verify_address may name besides --verify-address: comma-separated "
        "host:port, the host an IP, a CIDR block (10.0.0.0/8), a DNS name (its addresses too) or a pattern "
        "(*.verify.svc.cluster.local), the port a number or *; any other address is refused (PERMISSION_DENIED)",
    )
    speculative_algorithm: str = flags.option(
        "standalone",
        "standalone: a draft model; ngram: prompt lookup, no model; suffix: suffix trees over the prompt, the "
        "output and recent generations (vLLM's suffix method), no model",
        choices=ALGORITHMS,
        type=str.lower,
    )
    # Arctic Inference's name: its hybrid of suffix decoding and a draft model.
    enable_suffix_decoding: bool = flags.option(
        True,
        "standalone: each round takes the suffix trees' proposal (the prompt, the output, recent generations; "
        "the --suffix-decoding-* settings) or the draft model's, whichever promises more committed tokens per "
        "second; a round the suffix wins runs no draft forward",
    )
    speculative_num_steps: int = flags.option(4, "most draft tokens per block (K); adaptive K stays within it")
    adaptive: bool = flags.option(
        True,
        "choose K per session for the verifier's goodput, from live acceptance, timings and the verifier's load "
        "(down to 0)",
    )
    goodput_guard: bool = flags.option(  # specmesh.loop.GoodputGuard
        True,
        "adaptive K falls back to target-only while speculation measures fewer tokens per second than "
        "target-only steps (pooled over sessions; a few probe steps keep both sides measured)",
    )
    # The per-round side of the gateway's rule of the same name, for sessions that began speculating alone.
    speculative_disable_by_batch_size: int = flags.option(
        0,
        "adaptive K drafts nothing while the verifier's last batch held more sessions than this (0 = no limit; "
        "the gateway's flag of that name decides it for new requests)",
    )
    pipeline: bool = flags.option(True, "keep drafting the next block while one is being verified")
    chain_blocks: bool = flags.option(
        True,
        "send the suffix trees' next block right behind the one being verified, drafted as if its verdict took "
        "it whole (the verifier verifies it at once where the guess holds, answers it stale where not); costs no "
        "draft forward, so unlike --pipeline it pays on a CPU the verifier saturates (not for seeded requests)",
    )
    draft_topk: int = flags.option(
        16, "sampled drafts: the support of the sparse draft distribution sent with each token"
    )
    draft_runner: str = flags.option(
        "auto",
        "batched: one forward advances every drafting session, each in a KV slot (Llama family); paged: the same "
        "with the KV in blocks (CUDA graphs on CUDA); gguf: the same on llama.cpp's CPU kernels (Llama, "
        "llama-cpp-python installed); static: one session per forward, preallocated cache; hf: the stock HF "
        "forward; auto: paged on CUDA, batched elsewhere, where the model allows it",
        choices=RUNNERS,
    )
    attention_backend: str = flags.attention_backend_option(ATTENTION_BACKENDS)
    cuda_graph_max_bs: int = flags.cuda_graph_max_bs_option()
    disable_cuda_graph: bool = flags.disable_cuda_graph_option()
    max_sessions: int = flags.option(64, "concurrent generations; more get RESOURCE_EXHAUSTED")
    max_cached_sessions: int = flags.option(64, "per-session draft KV caches kept for later turns (LRU)")
    max_model_len: int = flags.option(
        0, "longest sequence a session's draft KV slot holds (0 = the model's max_position_embeddings)"
    )
    kv_cache_prefault: bool = flags.kv_cache_prefault_option()
    # vLLM's suffix decoding settings, its names and defaults (specmesh.drafters.suffix).
    suffix_decoding_max_tree_depth: int = flags.option(
        SuffixParams.max_tree_depth, "suffix: tokens of the suffix trees' paths, the match plus what it proposes"
    )
    suffix_decoding_max_cached_requests: int = flags.option(
        SuffixParams.max_cached_requests,
        "suffix: recent generations whose outputs the replica's global trees hold, evicted first in, first out "
        "(0 = no global tree, the request's own prompt and output only)",
    )
    suffix_decoding_max_spec_factor: float = flags.option(
        SuffixParams.max_spec_factor, "suffix: a proposal is at most this many tokens per token of the match"
    )
    suffix_decoding_min_token_prob: float = flags.option(
        SuffixParams.min_token_prob,
        "suffix: a proposal stops where the continuation's estimated probability (its frequency) falls below this",
    )
    verify_timeout_s: float = flags.option(60.0, "timeout of each call to the verifier")
    grace_period_s: float = flags.option(10.0, "on SIGTERM, in-flight generations get this long to finish")
    # The predict-verify-optimize loop (draft_service.online): off by default, as it costs a share of a core
    # and the verifier's top-k on every token.
    online_distill: bool = flags.option(
        False,
        "distil the draft from the verifier's top-k on live traffic while serving, swapping new weights in "
        "between rounds and rolling back a version whose live acceptance is worse (see README)",
    )
    online_distill_dir: str = flags.option(
        "", "save every weight version and its live acceptance here (empty = in memory only)"
    )
    online_distill_topk: int = flags.option(
        OnlineConfig.topk, "target tokens per position the verifier returns as feedback (1-20)"
    )
    online_distill_cpu_share: float = flags.option(
        OnlineConfig.cpu_share, "the trainer's share of one core's time (it sleeps the rest)"
    )
    online_distill_buffer: int = flags.option(
        OnlineConfig.buffer_windows, "replay buffer size, in training windows of 64 tokens"
    )
    online_distill_lr: float = flags.option(OnlineConfig.lr, "the trainer's learning rate (AdamW)")
    online_distill_kl_weight: float = flags.option(
        OnlineConfig.kl_weight,
        "weight of the KL to the target's top-k in the loss; the rest is cross-entropy on the committed token "
        "(1 = pure KL)",
    )
    online_distill_steps_per_version: int = flags.option(
        OnlineConfig.steps_per_version, "training steps between two weight versions"
    )
    online_distill_rollback_window: int = flags.option(
        OnlineConfig.rollback_window, "draft tokens a new version is judged on against its predecessor"
    )
    online_distill_rehearsal: str = flags.option(
        "auto",
        "windows of the draft's original domain with the target's top-k (python -m specmesh.training.rehearsal), "
        "mixed into every training batch so the draft keeps that domain: auto = the draft directory's "
        "rehearsal.safetensors if there is one, none = off, or a file",
    )
    online_distill_rehearsal_share: float = flags.option(
        OnlineConfig.rehearsal_share, "the share of each training batch drawn from the rehearsal set"
    )
    metrics_port: int = flags.metrics_port_option(9465)

    def __post_init__(self):
        if self.speculative_algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {ALGORITHMS}, got {self.speculative_algorithm!r}")
        if self.algorithm.needs_model and not self.model_path:
            raise ValueError("the standalone algorithm needs --model-path (the draft model)")
        if self.draft_runner not in RUNNERS:
            raise ValueError(f"draft_runner must be one of {RUNNERS}, got {self.draft_runner!r}")
        check_attention_backend(self.attention_backend)
        if self.cuda_graph_max_bs < 0:
            raise ValueError("cuda_graph_max_bs must be >= 0")
        if not 0 <= self.speculative_num_steps <= MAX_SPEC_LEN:
            raise ValueError(f"speculative_num_steps must be in [0, {MAX_SPEC_LEN}]")
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError("speculative_disable_by_batch_size must be >= 0")
        AllowList.parse(self.verify_allow)  # ValueError naming --verify-allow
        if self.online_distill:
            online_config(self)  # its knobs' checks and the rehearsal file's, as usage errors
        self.suffix_params()  # vLLM's bounds, naming the flag

    @property
    def graph_max_bs(self) -> int:
        """The runner's CUDA graph bound (0: none)."""
        return 0 if self.disable_cuda_graph else self.cuda_graph_max_bs

    @property
    def algorithm(self) -> Algorithm:
        return Algorithm(self.speculative_algorithm)

    @property
    def hybrid(self) -> bool:
        """The draft model and the suffix trees, chosen per round."""
        return self.algorithm is Algorithm.STANDALONE and self.enable_suffix_decoding

    def suffix_params(self) -> SuffixParams:
        return SuffixParams(
            max_tree_depth=self.suffix_decoding_max_tree_depth,
            max_cached_requests=self.suffix_decoding_max_cached_requests,
            max_spec_factor=self.suffix_decoding_max_spec_factor,
            min_token_prob=self.suffix_decoding_min_token_prob,
            flag=flags.flag_name,
        )


@dataclass(frozen=True)
class _Failed:
    """The generation's error, handed to the stream that answers the caller."""

    error: BaseException


def make_runner(model, config: DraftConfig) -> Runner[Any]:
    """The draft runner the config asks for (the draft's numerics cannot change the output distribution: the
    q a block carries is the q its tokens were sampled from, so the fastest runner is always safe).

    On CUDA `auto` is the paged runner, whose one-token steps replay CUDA graphs (a small draft's step is
    launch-bound there); its blocks hold every session at full length, as the slots would. On a CPU under
    `--dtype auto` the weights stay float32 and the batched runner's fused step reads them in bfloat16 panels
    (where the build packs panels): a draft step streams its weights, and half the bytes made the demo draft's
    one-token step ~40 % faster; `--dtype float32` keeps the step in float32."""
    kind, sessions = config.draft_runner, config.max_sessions + config.max_cached_sessions
    cuda = next(model.parameters()).device.type == "cuda"
    if kind == "auto" and cuda and batched_supported(model):
        kind = "paged"
    if kind != "paged":
        return build_runner(
            model,
            kind,
            num_slots=sessions,
            max_seq_len=config.max_model_len or None,
            prefault=config.kv_cache_prefault,
            attention_backend=config.attention_backend,
            step_panels=torch.bfloat16 if config.dtype == "auto" and not cuda else torch.float32,
        )
    length = config.max_model_len or int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if length < 2:
        raise ValueError("--draft-runner paged needs --max-model-len (the model's config sets no context)")
    return build_runner(
        model,
        "paged",
        num_blocks=sessions * -(-length // DRAFT_BLOCK_SIZE),
        block_size=DRAFT_BLOCK_SIZE,
        max_seq_len=config.max_model_len or None,
        prefault=config.kv_cache_prefault,
        attention_backend=config.attention_backend,
        cuda_graph_max_bs=config.graph_max_bs,
        # A draft step feeds one token per session, two after a block accepted whole (its last draft and
        # the bonus token); a step that feeds more (a catch-up) runs eagerly.
        graph_tokens_per_seq=2,
    )


class DraftEngine:
    def __init__(
        self,
        config: DraftConfig,
        model=None,
        stream_metrics: StreamMetrics | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        model_thread: ThreadPoolExecutor | None = None,
        tokenizer=None,
    ):
        """`on_batch(sessions, seconds)` is told of every batched draft forward (metrics). Every torch op runs
        on `model_thread`, building the runner (its probe forwards) included: a second OpenMP team, busy or
        spinning on another thread, slows every forward on a machine with few cores."""
        self.config = config
        self.model_thread = model_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-model")
        self.runner = self.model_thread.submit(make_runner, model, config).result() if model is not None else None
        self.vocab_size = self.runner.vocab_size if self.runner else 0
        self.batcher = (
            DraftBatcher(self.runner, config.draft_topk, self._on_model, on_batch, tokenizer)
            if self.runner is not None
            else None
        )
        self.totals = SpecStats()  # every finished generation's speculation statistics
        self.method = config.algorithm.method
        # The same, by the method that drafted (a hybrid round's: the method of its block's first token).
        methods = ("model", "suffix") if config.hybrid else (self.method,)
        self.by_method = {m: SpecStats() for m in methods}
        # The suffix trees' global half: the outputs of this replica's recent generations, by scope.
        suffix = config.algorithm is Algorithm.SUFFIX or config.hybrid
        self.suffix = SuffixCache(config.suffix_params()) if suffix else None
        # Every hybrid generation's measurements, greedy and sampled apart: at T = 0.7 a suffix proposal's
        # tokens are accepted with their probability only (16 % on the edit loop against 70 % greedy), and one
        # pooled calibration sent sampled requests the blocks greedy ones had earned.
        self.chooser = HybridChooser() if config.hybrid else None
        self.sampled_chooser = HybridChooser() if config.hybrid else None
        # Shared by every generation, one guard per kind of session (greedy or sampled, batch size)
        self.goodput_guards = GoodputGuards() if config.goodput_guard else None
        self.tracer = tracer("draft")
        self.stream_metrics = stream_metrics  # TTFT and inter-token latency of Generate streams
        self._drafters: OrderedDict[str, ModelDrafter] = OrderedDict()
        self._busy: set[str] = set()
        self._active = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._max_spec_len: dict[str, int] = {}  # each verify replica's limit, learnt from its Info
        self.verify_allow = AllowList.parse(config.verify_allow, always=[config.verify_address])
        self.security: Security | None = None  # TLS and service key of the channels to verify replicas
        self.shutting_down = False
        self.online: OnlineLoop | None = None
        self._learning: set[asyncio.Task] = set()  # outputs being added to the suffix method's global trees
        if config.online_distill and model is not None:
            self.online = OnlineLoop(model, online_config(config), self.model_thread)
            self.online.start()

    @classmethod
    def from_config(
        cls,
        config: DraftConfig,
        stream_metrics: StreamMetrics | None = None,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> DraftEngine:
        model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-model")
        model = tokenizer = None
        if config.algorithm.needs_model:
            model, tokenizer = model_thread.submit(load_model, config.model_path, config.device, config.dtype).result()
        return cls(config, model, stream_metrics, on_batch, model_thread, tokenizer)

    async def _on_model(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn, *args)

    async def close(self) -> None:
        if self.online is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.online.stop)
        if self.batcher is not None:
            await self.batcher.close()
        for ch in self._channels.values():
            await ch.close()
        self.model_thread.shutdown(wait=False, cancel_futures=True)

    async def _stub(self, address: str) -> tuple[verify_pb2_grpc.VerifyServiceStub, int]:
        """The replica's stub and its largest draft block; its Info is read at first contact."""
        if not address:
            raise InvalidArgument("no verify_address in the request and no --verify-address default")
        ch = self._channels.get(address)
        if ch is None:
            await self.verify_allow.check(address)
            ch = self._channels[address] = dial(address, self.security)
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        if address not in self._max_spec_len:
            info = await stub.Info(verify_pb2.VerifyServiceInfoRequest(), timeout=self.config.verify_timeout_s)
            if self.runner is not None and info.vocab_size != self.vocab_size:
                raise FailedPrecondition(
                    f"the draft's vocabulary ({self.vocab_size}) differs from the target's "
                    f"({info.vocab_size}) at {address}"
                )
            self._max_spec_len[address] = info.max_spec_len or MAX_SPEC_LEN
        return stub, self._max_spec_len[address]

    def _drafter(self, session_id: str, cache_scope: str = "", greedy: bool = True):
        """The session's drafter: a cached one keeps its draft KV cache for the session's next turn. A suffix
        drafter reads and feeds the global trees of the request's scope only."""
        algorithm = self.config.algorithm
        if not algorithm.needs_model or not session_id:
            return self._hybrid(make_drafter(algorithm, self.batcher, self.suffix, cache_scope), cache_scope, greedy)
        drafter = self._drafters.pop(session_id, None) or make_drafter(algorithm, self.batcher, cache_scope=cache_scope)
        assert isinstance(drafter, ModelDrafter)  # the algorithm needs a model, and there is one
        self._drafters[session_id] = drafter  # most recently used last
        while len(self._drafters) > self.config.max_cached_sessions:
            sid = next(iter(self._drafters))
            if sid in self._busy:
                break
            self._drafters.pop(sid).release()
        return self._hybrid(drafter, cache_scope, greedy)

    def _hybrid(self, drafter: Drafter | None, cache_scope: str, greedy: bool = True) -> Drafter | None:
        chooser = self.chooser if greedy else self.sampled_chooser
        if chooser is None or not isinstance(drafter, ModelDrafter):
            return drafter
        return HybridDrafter(drafter, SuffixDrafter(self.suffix, cache_scope), chooser)

    def learn(self, drafter: SuffixDrafter | HybridDrafter, output_ids: list[int]) -> None:
        """A finished generation's output joins its scope's global suffix tree, in a task of its own: its
        caller's last event does not wait for it, and it is scheduled before that event reaches the caller,
        so that the caller's next request finds it there."""
        task = asyncio.get_running_loop().create_task(drafter.finish(output_ids))
        self._learning.add(task)
        task.add_done_callback(self._learning.discard)

    def check(self, prompt_ids: list[int], params: SamplingParams, k: int | None) -> int:
        """Validate a request; returns its K max: None asks for the service's default, 0 for target-only."""
        params.validate(self.vocab_size or None)
        if not prompt_ids:
            raise InvalidArgument("prompt_ids must hold at least one token")
        if self.vocab_size:  # the n-gram drafter has no vocabulary: the verify service checks the ids
            check_token_ids(prompt_ids, self.vocab_size)
        if k is None:
            return self.config.speculative_num_steps
        if not 0 <= k <= MAX_SPEC_LEN:
            raise InvalidArgument(f"num_speculative_tokens must be in [0, {MAX_SPEC_LEN}], got {k}")
        return k

    def _admit(self, session_id: str) -> None:
        if self.shutting_down:
            raise Unavailable("the draft service is shutting down")
        if self._active >= self.config.max_sessions:
            raise ResourceExhausted(
                f"the draft service is at its limit of {self.config.max_sessions} concurrent generations; retry later"
            )
        if session_id and session_id in self._busy:
            raise FailedPrecondition(f"session {session_id!r} is already generating")

    async def generate(
        self,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        verify_address: str,
        num_speculative_tokens: int | None = None,
        metadata: tuple = (),
        goodput_probe: bool = False,
        cache_scope: str = "",
        hand_off: bool = False,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Yields Opened, then Tokens as rounds commit them, then Finished. `goodput_probe`: the caller sends
        most requests past this service while its guard says speculation loses, and this one to measure
        speculation (it takes none of the guard's target-only runs for its first `GoodputK.PROBE_ROUNDS` measured
        rounds); with `hand_off`, once those find speculation still losing, it ends there, Finished "handed_off"
        (the caller decodes the rest). `cache_scope`: the verify replica's prefix-cache scope, passed on."""
        k_max = self.check(prompt_ids, params, num_speculative_tokens)
        self._admit(session_id)
        stub, max_spec_len = await self._stub(verify_address or self.config.verify_address)
        k_max = min(k_max, max_spec_len)  # a K the replica would refuse is a K it cannot verify
        metadata = metadata or outgoing_metadata()
        self._active += 1
        if session_id:
            self._busy.add(session_id)
        released = False

        def release() -> None:
            # Before the final event goes out: the caller's next turn must find the session free here.
            nonlocal released
            if not released:
                released = True
                self._active -= 1
                self._busy.discard(session_id)

        try:
            if k_max == 0:  # target-only: the verify service decodes alone, nothing to draft
                timeout = self.config.verify_timeout_s
                events = _target_only(stub, session_id, prompt_ids, params, metadata, timeout, cache_scope)
            else:
                probe = (goodput_probe, hand_off and goodput_probe)
                gen = _Generation(self, stub, session_id, prompt_ids, params, k_max, metadata, probe, cache_scope)
                # The trees' blocks: to the request's K, or the replica's.
                if isinstance(gen.drafter, (HybridDrafter, SuffixDrafter)):
                    gen.drafter.cap = k_max if num_speculative_tokens is not None else max_spec_len
                events = gen.run()
            timer = self.stream_metrics.timer() if self.stream_metrics is not None else None
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Tokens) and timer is not None:
                        timer.tokens(len(event.token_ids))
                    if isinstance(event, Finished):
                        self.totals.merge(event.stats)
                        if self.chooser is None:  # a hybrid generation splits its own by method
                            self.by_method[self.method].merge(event.stats)
                        release()
                    yield event
        finally:
            release()

    @property
    def cached_sessions(self) -> int:
        return len(self._drafters)

    @property
    def active(self) -> int:
        return self._active

    def model_drafts_unlikely(self, greedy: bool) -> bool:
        """Whether a generation starting now would likely draft by the trees or not at all: this replica runs
        more generations than --speculative-disable-by-batch-size (the verifier's batch is at least as large,
        and every round's model K is 0 there), or its goodput guard at this load measures the model's
        speculation losing. Such a generation's model prefill waits for its first model proposal."""
        limit = self.config.speculative_disable_by_batch_size
        if limit and self._active > limit:
            return True
        guard = self.goodput_guards.at(greedy, self._active) if self.goodput_guards is not None else None
        return guard is not None and guard.speculation_loses()

    def draft_seconds_per_token(self) -> float:
        st = self.batcher.stats if self.batcher is not None else None
        return st.seconds / st.rows if st is not None and st.rows else 0.0

    def info(self) -> dict:
        c = self.totals
        return dict(
            model_path=self.config.model_path if self.runner else "",
            algorithm=self.config.speculative_algorithm,
            vocab_size=self.vocab_size,
            speculative_num_steps=self.config.speculative_num_steps,
            adaptive=self.config.adaptive,
            pipelined=self.config.pipeline,
            default_verify_address=self.config.verify_address,
            active_sessions=self._active,
            rounds=c.rounds,
            drafted=c.drafted,
            accepted=c.accepted,
            pipelined_blocks_used=c.pipelined_used,
            pipelined_blocks_discarded=c.pipelined_discarded,
            draft_seconds_per_token=self.draft_seconds_per_token(),
            suffix_decoding=self.suffix is not None,  # hybrid or suffix: proposals that cost no draft forward
        )


async def _target_only(
    stub,
    session_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    metadata: tuple,
    timeout: float,
    cache_scope: str,
) -> AsyncGenerator[GenerationEvent, None]:
    """K = 0: relay the verify replica's own target-only generation (no verify session, no round trips)."""
    call = stub.Generate(
        verify_pb2.VerifyServiceGenerateRequest(
            session_id=session_id, prompt_ids=prompt_ids, params=wire.params_to_pb(params), cache_scope=cache_scope
        ),
        timeout=timeout,
        metadata=metadata,
    )
    finished = False
    try:
        async for pb in call:
            event = wire.event_from_pb(pb)
            finished = isinstance(event, Finished)
            yield event
    finally:
        if not finished:
            call.cancel()


class _Generation:
    """One Generate call: the speculation loop as a task, its events handed to the caller's stream."""

    def __init__(
        self,
        engine: DraftEngine,
        stub,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        k_max: int,
        metadata: tuple,
        probe: tuple[bool, bool] = (False, False),  # a goodput probe; one to hand back once measured losing
        cache_scope: str = "",
    ):
        goodput_probe, self.hand_off = probe
        self.engine, self.session_id, self.prompt_ids, self.params = engine, session_id, prompt_ids, params
        self.queue: asyncio.Queue[GenerationEvent | _Failed] = asyncio.Queue()
        self.remote = RemoteVerifier(
            stub,
            session_id,
            engine.config.verify_timeout_s,
            metadata=metadata,
            on_open=self._opened,
            cache_scope=cache_scope,
        )
        self.drafter = engine._drafter(session_id, cache_scope, params.greedy)
        if isinstance(self.drafter, HybridDrafter):
            self.drafter.defer_model = engine.model_drafts_unlikely(params.greedy)
        # A seeded request must replay exactly: its random draws may not depend on timing, so it gets a
        # fixed K and no drafting ahead (both adapt to how fast verdicts come back).
        seeded = params.seed is not None
        limit = engine.config.speculative_disable_by_batch_size
        adaptive = engine.config.adaptive and not seeded
        guards, runs = engine.goodput_guards, not goodput_probe
        self.policy = (
            GoodputK(k_max, batch_limit=limit, guard=guards, guard_runs=runs, sampled=not params.greedy)
            if adaptive
            else FixedK(k_max)
        )
        self.pipeline = engine.config.pipeline and not seeded
        self.chain = engine.config.chain_blocks and not seeded
        self.parent = otel_context.get_current()  # the Generate server span: rounds are its children

    def _opened(self, resp) -> None:
        self.queue.put_nowait(Opened(resp.session_id, len(self.prompt_ids), resp.cached_prompt_tokens))

    async def _loop(self) -> None:
        # EOS and stop strings are the verifier's to apply (its verdicts carry the finish reason).
        stop = StopChecker(replace(self.params, stop=()), frozenset())
        try:
            # No torch.inference_mode() around the await (see SpeculativeEngine.agenerate): the model work
            # runs on the model thread, inside the batcher's own inference mode.
            result = await speculative_generate(
                self.engine.online.wrap(self.remote) if self.engine.online is not None else self.remote,
                self.drafter,
                self.prompt_ids,
                self.params,
                self.policy,
                stop,
                on_tokens=lambda toks, logprobs: self.queue.put_nowait(Tokens(toks, logprobs)),
                pipeline=self.pipeline,
                chain=self.chain,
                on_round=self._trace_round,
                hand_off=self.policy.hands_off if self.hand_off and isinstance(self.policy, GoodputK) else None,
            )
            # Before the final event goes out: a caller's next turn must find the session free on the
            # verify service (the stream's status is awaited).
            await self.remote.aclose(result.finish_reason != "cancelled")
            if isinstance(self.drafter, (SuffixDrafter, HybridDrafter)):
                self.engine.learn(self.drafter, result.token_ids)
            if isinstance(self.drafter, HybridDrafter):
                for method, stats in self.drafter.by_method.items():
                    self.engine.by_method.setdefault(method, SpecStats()).merge(stats)
                    result.stats.by_method[method] = [stats.drafts, stats.drafted, stats.accepted]
            elif result.stats.drafts:
                s = result.stats
                s.by_method[self.engine.method] = [s.drafts, s.drafted, s.accepted]
            # The guard of this generation's kind at the load the caller's next request would meet here: the
            # generations this replica has in progress, this one included (a burst's last generation to
            # finish reports what a single stream measures, not the burst's rounds).
            guards = self.engine.goodput_guards
            guard = guards.at(self.params.greedy, self.engine.active) if guards is not None else None
            pays = guard.speculation_pays() if guard is not None else None
            self.queue.put_nowait(Finished(result.finish_reason, result.stats, pays))
        except Exception as e:  # noqa: BLE001 - delivered to the caller as a status
            self.queue.put_nowait(_Failed(e))

    def _trace_round(self, r: RoundRecord) -> None:
        now = time.perf_counter()
        span = self.engine.tracer.start_span(
            "draft.round",
            context=self.parent,
            start_time=wall_ns(r.t_start, now),
            attributes={
                "specmesh.k": r.k,
                "specmesh.drafted": r.num_drafted,
                "specmesh.accepted": r.num_accepted,
                "specmesh.committed": r.num_committed,
                "specmesh.draft_seconds": r.t_sent - r.t_start,
                "specmesh.verify_wait_seconds": r.t_verdict - r.t_sent,
                "specmesh.from_pipeline": r.from_pipeline,
            },
        )
        span.end(end_time=wall_ns(r.t_verdict, now))

    async def run(self) -> AsyncGenerator[GenerationEvent, None]:
        task = asyncio.get_running_loop().create_task(self._loop())
        try:
            while True:
                event = await self.queue.get()
                if isinstance(event, _Failed):
                    raise event.error
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            if not task.done():  # the caller went away: stop drafting and drop the verify stream
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await self.remote.aclose(False)
            if not self.session_id and isinstance(self.drafter, (ModelDrafter, HybridDrafter)):
                # A prefill still running owns the sequence: the cache goes back before the close returns.
                await self.drafter.settle()
                self.drafter.release()
