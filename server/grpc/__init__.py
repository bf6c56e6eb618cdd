"""The gRPC doors: attnserve.v1's EncoderService (encoder.py) and the Open Inference
Protocol's GRPCInferenceService (kserve.py), and what both share on their port: the
interceptor that checks keys and decodes requests off the event loop (calls.py, wire.py)
and the server with its health and reflection (server.py). No door imports another."""
