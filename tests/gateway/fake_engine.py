"""A fake Engine gRPC server for gateway tests: streams scripted token ids, honours max_tokens and EOS,
reports grpc health, and records every request, finish and cancellation (an abort) it sees. It serves the same
script on per-request Generate calls and on the multiplexed Session stream (the gateway's default). max_tokens is
resolved and checked against max_model_len by the real engine's own rule (resolve_max_tokens), so what the
gateway leaves to the engine is answered as the engine answers it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from steploop.common.beam_ranking import BeamRanking
from steploop.common.engine_contract import beam_config_from_pb, hypothesis_to_pb
from steploop.common.errors import CODE_KEY, PARAM_KEY
from steploop.common.pb.steploop.v1 import engine_pb2, engine_pb2_grpc
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.request import RequestRejectedError
from steploop.scheduler.request_outputs import resolve_max_tokens


@dataclass
class FakeEngine(engine_pb2_grpc.EngineServicer):
    reply_ids: Sequence[int]                       # the tokens every request gets (truncated by max_tokens)
    eos_token_id: int = 2
    max_model_len: int = 2048
    block_size: int = 16                           # what GetModelInfo reports (the router keys blocks by it)
    vocab_size: int = 49152
    num_workers: int = 1
    max_waiting: int = 1024                        # what GetModelInfo reports as the engine's --max-waiting
    token_delay_s: float = 0.0                     # sleep before each chunk (disconnect tests need it slow)
    tokens_per_chunk: int = 1
    cached_tokens: int = 0                         # usage.cached_tokens (first chunk with tokens, and last)
    status: grpc.StatusCode | None = None          # if set, Generate fails with it
    status_metadata: tuple = ()
    fail_after: int | None = None                  # if set, ends with FINISH_REASON_ERROR after this many tokens
    reject_after: int | None = None                # if set, ends with FINISH_REASON_REJECTED after this many tokens
    reply_fn: Callable[[engine_pb2.GenerateRequest], Sequence[int]] | None = None
    # if set: (top ids, their logprobs) for the next token after a request's prompt, most likely first (a tiny
    # deterministic "model"): a beam search request is searched over it; a request asking for logprobs gets
    # the first top id as its token, with the first logprob
    top_fn: Callable[[Sequence[int]], tuple[Sequence[int], Sequence[float]]] | None = None
    generation_defaults: dict = field(default_factory=dict)   # GetModelInfo's model sampling defaults
    requests: list = field(default_factory=list)   # GenerateRequests received
    finished: list = field(default_factory=list)   # request ids streamed to their end
    cancelled: list = field(default_factory=list)  # request ids whose call the client cancelled
    aborted: list = field(default_factory=list)    # ids sent to the Abort RPC

    sessions: int = 0                              # Session streams opened
    controls: list = field(default_factory=list)   # engine control calls: ("pause", mode), ("resume",), ...
    paused: bool = False
    weight_version: str = "0"
    weights_error: str = ""                        # if set, UpdateWeightsFromDisk is INVALID_ARGUMENT with it
    control_status: grpc.StatusCode | None = None  # if set, Pause and SwitchWeights fail with it (a broken replica)
    staged: str = ""                               # the model_path a stage_only update staged
    updates: int = 0                               # weight updates applied
    _drop: asyncio.Event = field(default_factory=asyncio.Event)
    _drops: int = 0                                # drop_sessions calls so far

    def drop_sessions(self) -> None:
        """Ends every open Session stream, and every Generate call, with UNAVAILABLE (a scheduler restart, as the
        gateway sees it)."""
        self._drop.set()
        self._drops += 1

    def _failure(self, request) -> tuple[grpc.StatusCode, str, tuple] | None:
        """(status, message, trailing metadata) the request fails with: the scripted one, else the engine's
        max_tokens rule; None when it runs."""
        if self.status is not None:
            return self.status, "scripted failure", self.status_metadata
        try:
            resolve_max_tokens(len(request.prompt_token_ids), SamplingParams.from_pb(request.sampling),
                               self.max_model_len)
        except RequestRejectedError as err:
            return grpc.StatusCode.INVALID_ARGUMENT, str(err), ((CODE_KEY, err.code), (PARAM_KEY, err.param))
        return None

    async def Generate(self, request, context):
        self.requests.append(request)
        failure = self._failure(request)
        if failure is not None:
            await context.abort(failure[0], failure[1], trailing_metadata=failure[2])
        drops = self._drops
        async for chunk in self._script(request):
            if self._drops != drops:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the call was dropped")
            yield chunk

    async def Session(self, request_iterator, context):
        """One task per request runs the script; every chunk goes out as its own SessionOutputs (the real engine
        merges per step; the gateway must not care)."""
        self.sessions += 1
        out: asyncio.Queue = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}

        async def run(request):
            try:
                failure = self._failure(request)
                if failure is not None:
                    meta = dict(failure[2])
                    out.put_nowait(engine_pb2.SessionChunk(request_id=request.request_id, error=engine_pb2.RequestError(
                        status_code=failure[0].value[0], message=failure[1],
                        code=meta.get("steploop-error-code", ""), param=meta.get("steploop-error-param", ""),
                        retry_after_s=int(meta.get("retry-after", 0)))))
                    return
                async for chunk in self._script(request):
                    out.put_nowait(engine_pb2.SessionChunk(request_id=request.request_id, chunk=chunk))
            finally:
                tasks.pop(request.request_id, None)

        async def read():
            async for message in request_iterator:
                if message.WhichOneof("kind") == "generate":
                    self.requests.append(message.generate)
                    tasks[message.generate.request_id] = asyncio.create_task(run(message.generate))
                elif message.WhichOneof("kind") == "abort":
                    for request_id in message.abort.request_ids:
                        if request_id in tasks:
                            tasks[request_id].cancel()

        reader = asyncio.create_task(read())
        self._drop.clear()
        dropped = asyncio.create_task(self._drop.wait())
        try:
            while True:
                chunk = asyncio.create_task(out.get())
                await asyncio.wait([chunk, dropped], return_when=asyncio.FIRST_COMPLETED)
                if dropped.done():
                    chunk.cancel()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the session was dropped")
                await context.write(engine_pb2.SessionOutputs(chunks=[chunk.result()]))
        finally:
            dropped.cancel()
            reader.cancel()
            for task in list(tasks.values()):
                task.cancel()

    def _beams(self, request) -> engine_pb2.GenerateChunk:
        """A beam search request, searched as the scheduler searches it (the one ranking, over top_fn's top K)."""
        sampling = SamplingParams.from_pb(request.sampling)
        max_tokens = resolve_max_tokens(len(request.prompt_token_ids), sampling, self.max_model_len)
        stops = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else {self.eos_token_id})
        ranking = BeamRanking(beam_config_from_pb(request.beam_search), max_tokens, stops)
        k, prompt = max(ranking.k, sampling.logprobs), list(request.prompt_token_ids)
        while not ranking.done:
            ranking.step([list(zip(*self.top_fn(prompt + b.tokens)))[:k] for b in ranking.running])
        chunk = engine_pb2.GenerateChunk(finish_reason=engine_pb2.FINISH_REASON_STOP,
                                         beams=[hypothesis_to_pb(h) for h in ranking.finished])
        chunk.usage.prompt_tokens = len(prompt)
        chunk.usage.completion_tokens = max(len(h.tokens) for h in ranking.finished)
        chunk.usage.cached_tokens = self.cached_tokens
        return chunk

    async def _script(self, request):
        if request.HasField("beam_search"):
            yield self._beams(request)
            self.finished.append(request.request_id)
            return
        ids = list(self.reply_fn(request) if self.reply_fn else self.reply_ids)
        if not request.sampling.ignore_eos and self.eos_token_id in ids:
            ids = ids[:ids.index(self.eos_token_id) + 1]
            finish = engine_pb2.FINISH_REASON_STOP
        else:
            finish = engine_pb2.FINISH_REASON_LENGTH
        max_tokens = resolve_max_tokens(len(request.prompt_token_ids), SamplingParams.from_pb(request.sampling),
                                        self.max_model_len)
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], engine_pb2.FINISH_REASON_LENGTH
        resumed = list(request.resume_output_token_ids)   # migrated here: go on after what was delivered
        assert ids[:len(resumed)] == resumed, f"resumed with {resumed}, the script is {ids}"
        num_outputs, ids = len(ids), ids[len(resumed):]
        try:
            if self.fail_after is not None:
                yield engine_pb2.GenerateChunk(token_ids=ids[:self.fail_after])
                yield engine_pb2.GenerateChunk(finish_reason=engine_pb2.FINISH_REASON_ERROR,
                                               error_message="worker exploded")
                return
            if self.reject_after is not None:      # as the scheduler ends a request its worker cannot serve
                if self.reject_after:
                    yield engine_pb2.GenerateChunk(token_ids=ids[:self.reject_after])
                yield engine_pb2.GenerateChunk(
                    finish_reason=engine_pb2.FINISH_REASON_REJECTED, error_code="invalid_grammar",
                    error_param="json_schema", error_message="the JSON schema does not compile: scripted",
                    usage=engine_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                           completion_tokens=self.reject_after))
                return
            for start in range(0, len(ids), self.tokens_per_chunk):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                part = ids[start:start + self.tokens_per_chunk]
                chunk = engine_pb2.GenerateChunk(token_ids=part)
                k = request.sampling.logprobs
                if k >= 0 and self.top_fn is not None:
                    ids_k, lps_k = self.top_fn(list(request.prompt_token_ids))
                    chunk.token_ids[:] = [ids_k[0]]
                    chunk.logprobs.append(engine_pb2.TokenLogprob(logprob=lps_k[0], top_token_ids=ids_k[:k],
                                                                  top_logprobs=lps_k[:k]))
                elif k >= 0:   # scripted logprobs: -0.5 for the token, top k ids 0..k-1 at -1, -2, ...
                    chunk.logprobs.extend(engine_pb2.TokenLogprob(logprob=-0.5, top_token_ids=range(k),
                                                                  top_logprobs=[-1.0 - i for i in range(k)])
                                          for _ in part)
                if start == 0 and request.sampling.HasField("prompt_logprobs"):
                    pk = request.sampling.prompt_logprobs   # scripted: -0.25, rank 3, top ids 0..pk-1 at -1, -2..
                    chunk.prompt_logprobs.extend(engine_pb2.TokenLogprob(
                        logprob=-0.25, rank=3, top_token_ids=range(pk), top_logprobs=[-1.0 - i for i in range(pk)])
                        for _ in request.prompt_token_ids[1:])
                if start == 0 and not resumed:   # as the engine: usage so far with its first tokens, then at the end
                    chunk.usage.prompt_tokens = len(request.prompt_token_ids)
                    chunk.usage.completion_tokens = len(part)
                    chunk.usage.cached_tokens = self.cached_tokens
                if start + self.tokens_per_chunk >= len(ids):
                    chunk.finish_reason = finish
                    chunk.usage.prompt_tokens = len(request.prompt_token_ids)
                    chunk.usage.completion_tokens = num_outputs
                    chunk.usage.cached_tokens = self.cached_tokens
                yield chunk
            self.finished.append(request.request_id)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def Abort(self, request, context):
        self.aborted.extend(request.request_ids)
        return engine_pb2.AbortResponse(num_aborted=0)

    async def WatchKVEvents(self, request, context):
        """As a scheduler started without --kv-events-config answers: the router then guesses."""
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV cache events are off (--kv-events-config)")

    async def GetModelInfo(self, request, context):
        return engine_pb2.ModelInfo(model_name="fake", max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                    block_size=self.block_size, num_kv_blocks=100 if self.num_workers else 0,
                                    eos_token_ids=[self.eos_token_id], num_workers=self.num_workers,
                                    max_waiting=self.max_waiting, runner="generate" if self.num_workers else "",
                                    generation_defaults=engine_pb2.GenerationDefaults(**self.generation_defaults))

    async def Pause(self, request, context):
        self.controls.append(("pause", engine_pb2.PauseMode.Name(request.mode)))
        if self.control_status is not None:
            await context.abort(self.control_status, "the scheduler cannot pause now")
        self.paused = True
        return engine_pb2.EngineControlState(paused=True, weight_version=self.weight_version)

    async def Resume(self, request, context):
        self.controls.append(("resume",))
        self.paused = False
        return engine_pb2.EngineControlState(paused=False, weight_version=self.weight_version)

    async def GetEngineControlState(self, request, context):
        return engine_pb2.EngineControlState(paused=self.paused, weight_version=self.weight_version)

    async def UpdateWeightsFromDisk(self, request, context):
        self.controls.append(("update_weights", request.model_path, request.weight_version))
        if self.weights_error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.weights_error)
        if request.stage_only:
            self.controls[-1] += ("stage",)
            self.staged = request.model_path
            return engine_pb2.EngineControlState(paused=self.paused, weight_version=self.weight_version,
                                                 weight_updates=self.updates, weights_staged=True)
        self.updates += 1
        self.weight_version = request.weight_version or str(self.updates)
        return engine_pb2.EngineControlState(paused=self.paused, weight_version=self.weight_version,
                                             weight_updates=1)

    async def SwitchWeights(self, request, context):
        self.controls.append(("switch_weights", request.commit, request.weight_version))
        if self.control_status is not None:
            await context.abort(self.control_status, "the scheduler lost its worker group")
        if not self.staged:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no weights are staged")
        self.staged = ""
        if request.commit:
            self.updates += 1
            self.weight_version = request.weight_version or str(self.updates)
        return engine_pb2.EngineControlState(paused=self.paused, weight_version=self.weight_version)

    async def InitWeightsUpdateGroup(self, request, context):
        self.controls.append(("init_group", request.master_address, request.master_port, request.rank_offset,
                              request.world_size))
        return engine_pb2.EngineControlState(paused=self.paused, weight_version=self.weight_version)

    async def UpdateWeightsFromDistributed(self, request, context):
        self.controls.append(("update_distributed", [(t.name, t.dtype, list(t.shape)) for b in request.buckets
                                                     for t in b.tensors], [b.sha256 for b in request.buckets]))
        if request.stage_only:
            self.staged = "distributed"
            return engine_pb2.EngineControlState(paused=self.paused, weight_version=self.weight_version,
                                                 weights_staged=True)
        self.updates += 1
        self.weight_version = request.weight_version or str(self.updates)
        return engine_pb2.EngineControlState(paused=self.paused, weight_version=self.weight_version)

    async def Sleep(self, request, context):
        self.controls.append(("sleep", request.level))
        self.paused = True
        return engine_pb2.EngineControlState(paused=True, sleep_level=request.level, worker_rss_bytes=[1 << 20])

    async def WakeUp(self, request, context):
        self.controls.append(("wake_up",))
        self.paused = False
        return engine_pb2.EngineControlState(paused=False, worker_rss_bytes=[2 << 20])

    async def GetLoadReport(self, request, context):
        return engine_pb2.LoadReport()

    async def GetMetrics(self, request, context):
        """One gauge and one counter, in the scheduler's exposition format: requests seen so far."""
        n = len(self.requests)
        return engine_pb2.MetricsText(text=(
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="fake"}} {n}.0\n'
            "# HELP vllm:prompt_tokens Number of prefill tokens processed.\n"
            "# TYPE vllm:prompt_tokens counter\n"
            f'vllm:prompt_tokens_total{{model_name="fake"}} {10 * n}.0\n'))


async def start_fake_engine(engine: FakeEngine,
                            health_status=health_pb2.HealthCheckResponse.SERVING) -> tuple[grpc.aio.Server, str,
                                                                                           health_aio.HealthServicer]:
    """Serves `engine` on a free loopback port; returns (server, "127.0.0.1:port", health servicer)."""
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    health = health_aio.HealthServicer()
    await health.set("", health_status)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", health
