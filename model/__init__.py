"""The PyTorch encoders: attention, blocks, positions, the families, heads and weight loading."""

from attnserve.model.checkpoint import CheckpointError, load_checkpoint
from attnserve.model.classifier import CrossEncoder
from attnserve.model.config import DecoderConfig, EncoderConfig, EncoderShape, HeadConfig, ModernBertConfig
from attnserve.model.decoder import Decoder
from attnserve.model.encoder import Encoder, EncoderOutput
from attnserve.model.families import AnyEncoder
from attnserve.model.modernbert import ModernBertEncoder

__all__ = ["AnyEncoder", "CheckpointError", "CrossEncoder", "Decoder", "DecoderConfig", "Encoder",
           "EncoderConfig", "EncoderOutput", "EncoderShape", "HeadConfig", "ModernBertConfig",
           "ModernBertEncoder", "load_checkpoint"]
