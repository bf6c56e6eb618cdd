"""The PyTorch encoders: attention, blocks, positions, the families, heads and weight loading."""

from attnserve.model.checkpoint import CheckpointError, load_checkpoint
from attnserve.model.classifier import CrossEncoder
from attnserve.model.config import EncoderConfig, EncoderShape
from attnserve.model.encoder import Encoder
from attnserve.model.families import AnyEncoder

__all__ = ["AnyEncoder", "CheckpointError", "CrossEncoder", "Encoder", "EncoderConfig", "EncoderShape",
           "load_checkpoint"]
