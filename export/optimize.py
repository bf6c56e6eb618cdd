"""onnxruntime's transformer optimiser: fused Attention and BiasGelu kernels (and SkipLayerNorm
in the float16 variants for the CUDA provider)."""

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

from onnx import GraphProto, NodeProto, TensorProto, ValueInfoProto
from onnxruntime.transformers.fusion_options import FusionOptions
from onnxruntime.transformers.optimizer import optimize_model

from attnserve.artifact import POOLED_OUTPUTS
from attnserve.export.graph_files import large, share_mode
from attnserve.export.onnx_graphs import POOL_SCOPE
from attnserve.model import EncoderShape

log = logging.getLogger("attnserve.export")

# Kept in float32 inside fp16 graphs, so the attention probabilities callers get back sum
# to one. LayerNorm needs no block: onnxruntime's half-precision LayerNorm kernels already
# accumulate mean and variance in float32 (and blocking them makes the converter emit
# duplicate Cast names when layers share an initializer).
FP32_OPS = ["Softmax"]


@dataclass
class _Pooling:
    nodes: list[NodeProto]
    outputs: list[ValueInfoProto]
    own: list[TensorProto]
    """initializers only the pooling reads (the Dense layers' weights): taken out with it"""
    shared: list[TensorProto | NodeProto]
    """initializers and Constant nodes outside the pooling scope it reads (the exporter
    shares equal constants): the converter prunes them once their other readers are gone"""


def _take_pooling(graph: GraphProto) -> _Pooling:
    """Take the pooling nodes, the initializers only they read and the pooled outputs out of `graph`."""
    nodes = [n for n in graph.node if n.name.startswith(POOL_SCOPE)]
    outputs = [o for o in graph.output if o.name in POOLED_OUTPUTS]
    produced = {name for n in nodes for name in n.output}
    read = {name for n in nodes for name in n.input if name} - produced
    read_elsewhere = {name for n in graph.node if not n.name.startswith(POOL_SCOPE) for name in n.input}
    own = [copy.deepcopy(i) for i in graph.initializer if i.name in read - read_elsewhere]
    shared: list[TensorProto | NodeProto] = [copy.deepcopy(i) for i in graph.initializer
                                             if i.name in read & read_elsewhere]
    shared += [copy.deepcopy(n) for n in graph.node
               if n.op_type == "Constant" and n not in nodes and set(n.output) & read]
    for constant in shared:
        if isinstance(constant, TensorProto) and constant.data_type == TensorProto.FLOAT:
            raise ValueError(f"pooling reads float initializer {constant.name}, which the "
                             "float16 converter would change")
    for n in nodes:
        graph.node.remove(n)
    for o in outputs:
        graph.output.remove(o)
    for i in [i for i in graph.initializer if i.name in read - read_elsewhere]:
        graph.initializer.remove(i)
    for info in [v for v in graph.value_info if v.name in produced]:
        graph.value_info.remove(info)  # the converter would mark them float16
    return _Pooling(nodes, outputs, own, shared)


def _put_back(graph: GraphProto, pooling: _Pooling) -> None:
    graph.initializer.extend(pooling.own)
    present = {i.name for i in graph.initializer} | {name for n in graph.node for name in n.output}
    for constant in pooling.shared:
        if isinstance(constant, TensorProto) and constant.name not in present:
            graph.initializer.append(constant)
        elif isinstance(constant, NodeProto) and constant.output[0] not in present:
            graph.node.append(constant)
    graph.node.extend(pooling.nodes)  # saving sorts the nodes topologically
    graph.output.extend(pooling.outputs)


def optimize(source: Path, target: Path, config: EncoderShape, fuse_attention: bool,
             fp16: bool) -> None:
    """Write the optimised graph, and log onnxruntime's count of fused operators.

    The graph that outputs attention probabilities keeps its explicit softmax: the
    fused Attention kernel does not expose them, and fusing it writes a graph
    onnxruntime refuses ("Graph output (attentions.0) does not exist").

    In a float16 graph the pooling stays float32, fed by the float32 hidden state the
    graph outputs: a mean over up to 512 tokens summed in float16 loses digits callers'
    cosine similarities need. The converter cannot keep a chain of nodes float32 (it casts
    every blocked node's inputs and outputs to and from float16), so the pooling nodes
    are taken out before it runs and put back after.
    """
    options = FusionOptions("bert")
    options.enable_attention = fuse_attention
    # onnxruntime's CPU SkipLayerNormalization kernel is 2.5x slower than the Add and the
    # LayerNormalization it replaces (5.6 vs 2.3 ms a layer norm at 32x128 tokens on 2 cores
    # with AVX-512 VNNI, onnxruntime 1.31), 4-18 % of the whole fp32 graph; the CUDA kernel
    # is the faster one.
    options.enable_skip_layer_norm = fp16
    # The optimiser logs every fusion at INFO; our own step lines say what matters.
    logging.disable(logging.INFO)
    try:
        model = optimize_model(str(source), model_type="bert", num_heads=config.num_heads,
                               hidden_size=config.hidden_size, optimization_options=options, opt_level=0,
                               use_gpu=fp16)
        if fp16:
            pooling = _take_pooling(model.model.graph)
            model.convert_float_to_float16(keep_io_types=True, op_block_list=FP32_OPS)
            _put_back(model.model.graph, pooling)
        # Its data file, when it needs one, named as graph_files.data_file names it.
        model.save_model_to_file(str(target), use_external_data_format=large(model.model))
        share_mode(target)
        fused = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
    finally:
        logging.disable(logging.NOTSET)
    log.info("event=optimized graph=%s fused=%s", target.name, fused)
