"""The PyTorch encoder: attention, blocks, positions and weight loading."""

from model.checkpoint import CheckpointError, load_checkpoint
from model.config import EncoderConfig
from model.encoder import Encoder, EncoderOutput

__all__ = ["CheckpointError", "Encoder", "EncoderConfig", "EncoderOutput", "load_checkpoint"]
