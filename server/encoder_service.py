"""attnserve.v1.EncoderService: texts or token ids in, embeddings and attention maps out."""

import asyncio
import time

import numpy as np

from attnserve.artifact import Artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from attnserve.server.backend import Backend
from attnserve.server.calls import answer, call_holds, deadline_of
from attnserve.server.errors import InvalidArgument
from attnserve.server.executors import Executors
from attnserve.server.holds import Holds
from attnserve.server.metrics import Metrics
from attnserve.server.parse import POOLING_NAMES, plan_embed, token_id_sequences
from attnserve.server.request_queue import RequestQueue
from attnserve.server.respond import (
    EMBED_ADVICE,
    build_response,
    check_response_size,
    embed_response_bytes,
    embedding,
    field_bytes,
    outputs_for,
)
from attnserve.server.tokenize import Encoded, TextTokenizer, TooLong

TOKENIZE_ADVICE = "send fewer texts per request"
# A request this small is tokenized (or its ids read) on the event loop, in well under
# a millisecond: the hop to the tokenizer thread and back cost 0.35 ms of a one-text
# call's 7 (16 tokens), and such calls are most of the traffic. Anything larger goes
# off the loop, so no request holds it in proportion to its size.
INLINE_SEQUENCES = 8
INLINE_UNITS = 4096
"""characters of text, or token ids"""


def _tokenization(e: Encoded) -> pb.Tokenization:
    return pb.Tokenization(ids=e.ids.tolist(), tokens=e.tokens,
                           offsets=[x for pair in e.offsets for x in pair])


class EncoderService(pb_grpc.EncoderServiceServicer):
    def __init__(self, artifact: Artifact, backend: Backend, tokenizer: TextTokenizer,
                 queue: RequestQueue, executors: Executors, metrics: Metrics,
                 max_message_bytes: int):
        self.artifact = artifact
        self.manifest = artifact.manifest
        self.backend = backend
        self.tokenizer = tokenizer
        self.queue = queue
        self.executors = executors
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.ledger = queue.memory.ledger
        # The smallest Tokenization (an empty text's): the cheap size bound of a request.
        self.least_tokenization = _tokenization(tokenizer.empty).ByteSize()

    async def _off_loop(self, work, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executors.tokenize, work, *args)

    async def _small_or_off_loop(self, small: bool, work, *args):
        return work(*args) if small else await self._off_loop(work, *args)

    async def _tokenize(self, texts, truncate: bool, holds: Holds, details: bool) -> list[Encoded]:
        """Off the event loop unless the texts are few and short (the texts copied out of
        the request there too)."""
        started = time.perf_counter()
        small = (len(texts) <= INLINE_SEQUENCES
                 and sum(len(text) for text in texts) <= INLINE_UNITS)
        try:
            return await self._small_or_off_loop(
                small, lambda: self.tokenizer.encode(list(texts), truncate, holds, details))
        except TooLong as err:
            raise InvalidArgument("texts", str(err)) from err
        finally:
            self.metrics.stage_duration.labels("tokenize").observe(time.perf_counter() - started)

    async def _sequences(self, request: pb.EmbedRequest,
                         holds: Holds) -> tuple[list[np.ndarray], np.ndarray]:
        if request.token_ids:
            entries = request.token_ids
            small = (len(entries) <= INLINE_SEQUENCES
                     and sum(len(entry.ids) for entry in entries) <= INLINE_UNITS)
            return await self._small_or_off_loop(small, token_id_sequences, request, self.manifest)
        sequences = [e.ids for e in await self._tokenize(request.texts, request.truncate, holds,
                                                         details=False)]
        return sequences, np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))

    async def embed(self, request: pb.EmbedRequest, deadline: float | None,
                    holds: Holds | None = None, float_bytes: float | None = None) -> pb.EmbedResponse:
        """One Embed call, whichever protocol it came in by; `deadline` on the monotonic
        clock. `holds`: the call's memory, released by the caller once the response has
        been sent (by default, held until this returns); `float_bytes`: what a value
        takes where the response is re-encoded (JSON), for the size limit."""
        if holds is None:
            holds = self.ledger.holds()
            try:
                return await self.embed(request, deadline, holds, float_bytes)
            finally:
                holds.release()
        plan = plan_embed(request, self.manifest)
        # The cheap bounds first, from the count of sequences alone (each has at least an
        # empty text's tokens, or one id): a request that cannot be served is refused
        # before any text is tokenized or any id read.
        count = len(request.texts) or len(request.token_ids)
        least = len(self.tokenizer.empty.ids) if request.texts else 1
        self.queue.admit(count * least, at_least=True)
        check_response_size(embed_response_bytes(plan, np.full(count, least), self.manifest,
                                                 float_bytes),
                            self.max_message_bytes, EMBED_ADVICE, at_least=True)
        sequences, lengths = await self._sequences(request, holds)
        size = check_response_size(embed_response_bytes(plan, lengths, self.manifest, float_bytes),
                                   self.max_message_bytes, EMBED_ADVICE)
        layers = plan.attention.graph_layers if plan.attention else ()
        results = await self.queue.submit(sequences, layers, deadline, size, outputs_for(plan),
                                          holds, lengths)

        def respond() -> pb.EmbedResponse:
            response = pb.EmbedResponse(model=self.manifest.model_name,
                                        total_tokens=int(lengths.sum()))
            # One at a time: a list handed to the constructor is copied in one call that
            # holds the interpreter for as long as the whole response takes.
            for result, ids in zip(results, sequences, strict=True):
                response.embeddings.append(embedding(result, ids, plan))
            return response

        return await build_response(self.executors.respond, self.metrics, respond,
                                    len(sequences), size)

    async def Embed(self, request, context):
        return await answer(self.metrics, "Embed", context,
                            lambda: self.embed(request, deadline_of(context), call_holds()))

    async def EmbedStream(self, request_iterator, context):
        holds = call_holds()
        async for request in request_iterator:
            # Each answer's memory is held until it has been written: the stream takes
            # the next request only then, so a caller that stops reading holds one.
            before = holds.total
            try:
                yield await answer(self.metrics, "EmbedStream", context,
                                   lambda request=request: self.embed(
                                       request, deadline_of(context), holds))
            finally:
                holds.give_back(holds.total - before)

    async def Tokenize(self, request, context):
        async def handle():
            count = len(request.texts)
            if not count:
                raise InvalidArgument("texts", "empty request")
            check_response_size(count * field_bytes(self.least_tokenization),
                                self.max_message_bytes, TOKENIZE_ADVICE, at_least=True)
            holds = call_holds()
            encoded = await self._tokenize(request.texts, request.truncate, holds, details=True)
            return await self._off_loop(self._tokenize_response, encoded, holds)
        return await answer(self.metrics, "Tokenize", context, handle)

    def _tokenize_response(self, encoded: list[Encoded], holds: Holds) -> pb.TokenizeResponse:
        response = pb.TokenizeResponse()
        for e in encoded:  # one at a time, as Embed's
            response.tokenizations.append(_tokenization(e))
        size = check_response_size(response.ByteSize(), self.max_message_bytes, TOKENIZE_ADVICE)
        holds.take(self.queue.memory.response_copies * size, "the response")
        return response

    async def GetModelInfo(self, request, context):
        async def handle():
            m = self.manifest
            return pb.GetModelInfoResponse(
                model=m.model_name, hidden_size=m.hidden_size, num_layers=m.num_layers,
                num_heads=m.num_heads, max_positions=m.max_positions, vocab_size=m.vocab_size,
                default_pooling=POOLING_NAMES.get(m.default_pooling, pb.POOLING_MEAN),
                execution_provider=self.backend.provider, precision=self.backend.precision,
                artifact_sha256=self.artifact.manifest_sha256,
            )
        return await answer(self.metrics, "GetModelInfo", context, handle)
