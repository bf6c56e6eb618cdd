"""The GPU benchmark's PyTorch phase, for a machine whose onnxruntime has no CUDA provider:
our PyTorch model (model/) on the device, weights from the checkpoint the artifact was
exported from. fp32 on the device against the CPU and fp16 against fp32 on one ragged
batch, tokens/s at the fixed shapes, and torch.cuda.max_memory_allocated against seq_len.
It runs after every onnxruntime phase, so torch is never busy beside onnxruntime."""

import copy
import logging

import numpy as np

from bench.gpu_engines import parity, parity_batch
from bench.gpu_plan import MEMORY_BATCHES, Inputs, Plan
from bench.measure import Budget, shape_row, time_calls
from bench.workloads import padded_batch, shape_name

log = logging.getLogger("bench.gpu_bench")

MEMORY_BATCH = max(MEMORY_BATCHES)


def torch_phase(checkpoint: str | None, device: str, plan: Plan, inputs: Inputs, budget: Budget) -> dict:
    import torch

    from attnserve.model import load_checkpoint

    if device == "cuda" and not torch.cuda.is_available():
        return {"error": "torch.cuda.is_available() is False"}
    dev = torch.device(device)
    model = load_checkpoint(checkpoint).eval().to(dev)
    config = model.config
    out: dict = {"torch": torch.__version__, "device": str(dev),
                 "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "parity": {}, "throughput": {}, "memory": {}}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def forward(m, ids: np.ndarray, mask: np.ndarray, attentions: bool = False):
        with torch.inference_mode():
            return m(torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev),
                     output_attentions=attentions)

    def hidden(m, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return forward(m, ids, mask).last_hidden_state.float().cpu().numpy()

    ids, mask = parity_batch(inputs, config.pad_token_id)
    reference = hidden(model, ids, mask)
    half = model  # fp16 matmuls are CUDA's; on the CPU the dry run stays fp32
    if device == "cuda":
        out["parity"]["fp32_cuda_vs_cpu"] = parity(hidden(load_checkpoint(checkpoint).eval(), ids, mask),
                                                   reference, mask)
        half = copy.deepcopy(model).half()
    out["parity"]["fp16_vs_fp32"] = parity(reference, hidden(half, ids, mask), mask)
    log.info("phase=torch parity %s", out["parity"])
    for precision, m in (("fp32", model), ("fp16", half)):
        rows: dict = {}
        for shape in plan.backend_shapes:
            if not budget.enough(60):
                rows[shape_name(*shape)] = "skipped: time budget"
                continue
            batch = padded_batch(inputs.shapes[shape].ids, config.pad_token_id)
            seconds = time_calls(lambda b=batch, m=m: forward(m, *b), plan.backend_reps, sync=sync,
                                 keep_going=lambda: budget.enough(30))
            rows[shape_name(*shape)] = shape_row(seconds, *shape)
            log.info("phase=torch precision=%s shape=%s p50_ms=%.3f", precision, shape_name(*shape),
                     rows[shape_name(*shape)]["p50_ms"])
        out["throughput"][precision] = rows
    if device == "cuda":
        for precision, m in (("fp32", model), ("fp16", half)):
            for attentions in (False, True):
                name = f"{precision}_{'attentions' if attentions else 'embeddings'}"
                out["memory"][name] = rows = {}
                for seq in plan.memory_seqs:
                    if not budget.enough(30):
                        rows[str(seq)] = "skipped: time budget"
                        continue
                    # Random ids: the memory a batch takes depends on its shape alone.
                    ids = np.random.default_rng(seq).integers(1000, config.vocab_size, (MEMORY_BATCH, seq))
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    result = forward(m, ids, np.ones_like(ids), attentions)
                    torch.cuda.synchronize()
                    rows[str(seq)] = {"batch": MEMORY_BATCH,
                                      "peak_above_weights_bytes": torch.cuda.max_memory_allocated() - base}
                    del result
                log.info("phase=torch memory %s %s", name, rows)
    return out
