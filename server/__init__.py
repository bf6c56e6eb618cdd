"""The serving side, in layers that follow a request: the doors, grouped by transport
(server/grpc, server/http: each turning its wire format into engine requests, what every
call shares in call.py), the engine (server/engine: tokenize, admit, queue, batch), the
runtime (server/runtime: onnxruntime's sessions and how batches run on them) and memory
(server/memory: the budget, the ledger of what calls hold, the probes and the fitted
model). app.py assembles them (ports.py: the doors on their ports); config.py and
metrics.py serve all of them.

Never imports torch: the serving image carries onnxruntime, grpcio, tokenizers, numpy
and prometheus-client, nothing heavier.
"""
