"""Offline path: PyTorch encoder -> verified ONNX artifact directory. Never imported by the server."""
