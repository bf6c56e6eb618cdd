"""attnserve.v1.EncoderService: texts or token ids in, embeddings and attention maps out."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from attnserve.artifact import Artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from attnserve.server.calls import answer, deadline_of
from attnserve.server.errors import InvalidArgument
from attnserve.server.metrics import Metrics
from attnserve.server.parse import POOLING_NAMES, check_response_size, plan_embed, token_id_sequences
from attnserve.server.respond import embedding
from attnserve.server.runtime import Runtime
from attnserve.server.schedule import Scheduler
from attnserve.server.tokenize import TextTokenizer, TooLong

# Responses with more sequences than this, or with attention maps, are built on a thread:
# packing thousands of embeddings on the event loop stalled every other call (health
# checks included) for seconds.
INLINE_RESPONSE_SEQUENCES = 64


class EncoderService(pb_grpc.EncoderServiceServicer):
    def __init__(self, artifact: Artifact, runtime: Runtime, tokenizer: TextTokenizer,
                 scheduler: Scheduler, metrics: Metrics, max_message_bytes: int):
        self.artifact = artifact
        self.manifest = artifact.manifest
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        # Tokenizing off the event loop, so it never waits on a long text.
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.respond_pool = ThreadPoolExecutor(1, thread_name_prefix="respond")

    async def _tokenize(self, texts: list[str], truncate: bool):
        started = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.tokenize_pool, self.tokenizer.encode, list(texts), truncate)
        except TooLong as err:
            raise InvalidArgument("texts", str(err)) from err
        finally:
            self.metrics.stage_duration.labels("tokenize").observe(time.perf_counter() - started)

    async def _embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        plan = plan_embed(request, self.manifest)
        if request.texts:
            sequences = [e.ids for e in await self._tokenize(request.texts, request.truncate)]
        else:
            sequences = token_id_sequences(request, self.manifest)
        size = check_response_size(plan, [len(s) for s in sequences], self.manifest,
                                   self.max_message_bytes)
        layers = plan.attention.graph_layers if plan.attention else ()
        results = await self.scheduler.submit(sequences, layers, deadline_of(context), size)
        started = time.perf_counter()

        def respond() -> pb.EmbedResponse:
            return pb.EmbedResponse(
                model=self.manifest.model_name,
                total_tokens=sum(len(s) for s in sequences),
                embeddings=[embedding(r, s, plan) for r, s in zip(results, sequences, strict=True)],
            )

        if (len(sequences) <= INLINE_RESPONSE_SEQUENCES and plan.attention is None
                and not plan.return_token_embeddings):
            response = respond()
        else:
            response = await asyncio.get_running_loop().run_in_executor(self.respond_pool, respond)
        self.metrics.stage_duration.labels("respond").observe(time.perf_counter() - started)
        return response

    async def Embed(self, request, context):
        return await answer(self.metrics, "Embed", context, lambda: self._embed(request, context))

    async def EmbedStream(self, request_iterator, context):
        async for request in request_iterator:
            yield await answer(self.metrics, "EmbedStream", context,
                               lambda request=request: self._embed(request, context))

    async def Tokenize(self, request, context):
        async def handle():
            if not request.texts:
                raise InvalidArgument("texts", "empty request")
            encoded = await self._tokenize(request.texts, request.truncate)
            return pb.TokenizeResponse(tokenizations=[
                pb.Tokenization(ids=e.ids.tolist(), tokens=e.tokens,
                                offsets=[x for pair in e.offsets for x in pair])
                for e in encoded
            ])
        return await answer(self.metrics, "Tokenize", context, handle)

    async def GetModelInfo(self, request, context):
        async def handle():
            m = self.manifest
            return pb.GetModelInfoResponse(
                model=m.model_name, hidden_size=m.hidden_size, num_layers=m.num_layers,
                num_heads=m.num_heads, max_positions=m.max_positions, vocab_size=m.vocab_size,
                default_pooling=POOLING_NAMES.get(m.default_pooling, pb.POOLING_MEAN),
                execution_provider=self.runtime.provider, precision=self.runtime.precision,
                artifact_sha256=self.artifact.manifest_sha256,
            )
        return await answer(self.metrics, "GetModelInfo", context, handle)
