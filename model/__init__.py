"""The PyTorch encoders: attention, blocks, positions, the families and weight loading."""

from attnserve.model.checkpoint import CheckpointError, load_checkpoint
from attnserve.model.config import EncoderConfig, EncoderShape, ModernBertConfig
from attnserve.model.encoder import Encoder, EncoderOutput
from attnserve.model.families import AnyEncoder
from attnserve.model.modernbert import ModernBertEncoder

__all__ = ["AnyEncoder", "CheckpointError", "Encoder", "EncoderConfig", "EncoderOutput",
           "EncoderShape", "ModernBertConfig", "ModernBertEncoder", "load_checkpoint"]
