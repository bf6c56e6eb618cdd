"""What turns a scores graph's logits [inputs, labels] into the scores a caller gets, by the
name a manifest's `activation` gives it: the server's, and export's int8 gate on scores."""

import numpy as np


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x), as e^-log(1 + e^-x): without overflow for large negative x."""
    return np.exp(-np.logaddexp(0.0, -logits.astype(np.float64))).astype(np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)


ACTIVATIONS = {"softmax": softmax, "sigmoid": sigmoid, "none": lambda logits: logits}
"""a manifest's activation -> logits [inputs, labels] to scores"""
