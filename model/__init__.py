"""The PyTorch encoder: attention, blocks, positions and weight loading."""

from attnserve.model.checkpoint import CheckpointError, load_checkpoint
from attnserve.model.config import EncoderConfig
from attnserve.model.encoder import Encoder, EncoderOutput

__all__ = ["CheckpointError", "Encoder", "EncoderConfig", "EncoderOutput", "load_checkpoint"]
