"""The serving side: artifact, runtime, tokenizer, scheduler, servicers, metrics, CLI.

Never imports torch: the serving image carries onnxruntime, grpcio, tokenizers, numpy
and prometheus-client, nothing heavier.
"""
