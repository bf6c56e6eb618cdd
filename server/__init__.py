"""The serving side, in layers that follow a request (docs/architecture.md, "The server's
layers"): the doors (server/grpc, server/http; what every call shares in call.py), the
engine, the runtime and memory; app.py assembles them. Never imports torch: the serving
image carries onnxruntime, grpcio, tokenizers, numpy and prometheus-client, nothing heavier.
"""
