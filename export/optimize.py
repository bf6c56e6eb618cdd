"""onnxruntime's transformer optimiser: fused Attention, SkipLayerNorm and BiasGelu kernels,
and float16 variants for the CUDA provider."""

import logging
from pathlib import Path

from onnxruntime.transformers.fusion_options import FusionOptions
from onnxruntime.transformers.optimizer import optimize_model

from attnserve.model import EncoderConfig

log = logging.getLogger("attnserve.export")

# Kept in float32 inside fp16 graphs, so the attention probabilities callers get back sum
# to one. LayerNorm needs no block: onnxruntime's half-precision LayerNorm kernels already
# accumulate mean and variance in float32 (and blocking them makes the converter emit
# duplicate Cast names when layers share an initializer).
FP32_OPS = ["Softmax"]


def optimize(source: Path, target: Path, config: EncoderConfig, fuse_attention: bool,
             fp16: bool) -> dict[str, int]:
    """Write the optimised graph; returns onnxruntime's count of fused operators.

    The graph that outputs attention probabilities keeps its explicit softmax: the
    fused Attention kernel does not expose them, and fusing it writes a graph
    onnxruntime refuses ("Graph output (attentions.0) does not exist").
    """
    options = FusionOptions("bert")
    options.enable_attention = fuse_attention
    # The optimiser logs every fusion at INFO; our own step lines say what matters.
    logging.disable(logging.INFO)
    try:
        model = optimize_model(
            str(source),
            model_type="bert",
            num_heads=config.num_heads,
            hidden_size=config.hidden_size,
            optimization_options=options,
            opt_level=0,
            use_gpu=fp16,
        )
        if fp16:
            model.convert_float_to_float16(keep_io_types=True, op_block_list=FP32_OPS)
        model.save_model_to_file(str(target))
        fused = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
    finally:
        logging.disable(logging.NOTSET)
    log.info("event=optimized graph=%s fused=%s", target.name, fused)
    return fused
