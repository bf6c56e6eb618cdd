"""The runtime: the seam the batch loop runs batches through (backend.py), and onnxruntime
behind it: providers, graphs, sessions and shape strategies."""
