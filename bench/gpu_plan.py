"""What the GPU benchmark measures: its workloads, the server configurations, how much of
each (the full run, or the CPU dry run), and its inputs, texts of known token count
(bench/workloads.TextMaker) so that every engine gets the same ids."""

from dataclasses import dataclass
from pathlib import Path

from bench.measure import Reps
from bench.workloads import SHAPES, TextMaker, Texts, mixed_lengths

ONE_CALLER_SHAPES = ((1, 16), (32, 128), (128, 128), (32, 512))
CONCURRENT_SHAPE, CONCURRENT_CALLERS = (32, 128), 16
MIXED_CALLERS = 256
CLIENT_PROCESSES = 6
PARITY_ROWS = 8
"""the mixed texts a parity batch holds: rows of different lengths, padded"""
PRECISIONS = ("fp32", "fp16")
MEMORY_SEQS = (16, 64, 128, 256, 384, 512)
MEMORY_BATCHES = (1, 8, 32)


@dataclass(frozen=True)
class Plan:
    """How much of everything: the full run, or the CPU dry run."""

    one_caller_shapes: tuple[tuple[int, int], ...]
    reps: Reps
    concurrent_requests: int
    """requests of 32x128 the 16 callers send in all"""
    concurrent_callers: int
    mixed_texts: int
    mixed_callers: int
    client_processes: int
    server_args: tuple[str, ...]
    raw_sessions: tuple[int, ...]
    backend_shapes: tuple[tuple[int, int], ...]
    """the shapes of the backend's (and the PyTorch model's) tokens/s, per precision"""
    backend_reps: Reps
    memory_seqs: tuple[int, ...]
    memory_batches: tuple[int, ...]


FULL = Plan(ONE_CALLER_SHAPES, Reps(10, 400, 1.5, warmup=2, max_seconds=3.0), 640, CONCURRENT_CALLERS,
            8000, MIXED_CALLERS, CLIENT_PROCESSES, (), (1, 2, 4), SHAPES,
            Reps(5, 200, 2.0, max_seconds=float("inf")), MEMORY_SEQS, MEMORY_BATCHES)
QUICK = Plan(((1, 16), (32, 128)), Reps(2, 4, 0.0, warmup=1), 4, 2, 48, 8, 2,
             ("--max-batch-size", "4", "--max-batch-tokens", "512"), (1, 2), ((1, 16), (32, 128)),
             Reps(2, 200, 0.2, max_seconds=float("inf")), (16, 64), (1, 4))


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...]
    full: bool = False
    """every workload (else: 1x16 and 32x128 one caller, and the concurrent ones)"""


CONFIGS = (
    Config("default", ("--workers", "1"), full=True),
    Config("2 workers", ("--workers", "2")),
    Config("4 workers", ("--workers", "4")),
    Config("8 workers", ("--workers", "8")),
    Config("CUDA graphs", ("--cuda-graphs", "on", "--shape-buckets", "on")),
    Config("1 session", ("--sessions", "1")),
    Config("4 sessions", ("--sessions", "4")),
    Config("no buckets", ("--shape-buckets", "off")),
)


@dataclass
class Inputs:
    shapes: dict[tuple[int, int], Texts]
    """(batch, seq) -> batch texts of seq tokens each"""
    mixed: Texts
    """lognormal lengths (median 48, 8-256), one text a request"""


def make_inputs(tokenizer: Path, plan: Plan, max_positions: int) -> Inputs:
    maker = TextMaker(tokenizer, seed=0)
    shapes = sorted({*plan.one_caller_shapes, CONCURRENT_SHAPE, *plan.backend_shapes})
    made = {(batch, seq): maker.make([seq] * batch) for batch, seq in shapes}
    lengths = [min(n, max_positions) for n in mixed_lengths(plan.mixed_texts, seed=0)]
    return Inputs(made, maker.make(lengths))
