"""`attnserve classify`: every label's score of texts, or of (text, pair) pairs, with a
running server's classifier."""

import argparse
import sys

from attnserve.cli import texts_given
from attnserve.client import EncoderClient


def run_classify(args: argparse.Namespace) -> int:
    texts = texts_given(args.texts, args.file)
    if not texts:
        print("attnserve classify: give texts as arguments, or --file", file=sys.stderr)
        return 2
    if args.pair and len(args.pair) != len(texts):
        print(f"attnserve classify: {len(args.pair)} --pair for {len(texts)} texts: give one "
              "for each text, or none", file=sys.stderr)
        return 2
    root = args.tls_ca.read_bytes() if args.tls_ca else None
    with EncoderClient(args.address, root_certificates=root) as client:
        results = client.classify(texts, text_pairs=args.pair or None, top_k=args.top_k,
                                  raw_scores=args.raw_scores, truncate=args.truncate, model=args.model)
    for i, (text, scores) in enumerate(zip(texts, results, strict=True)):
        pair = f" + {args.pair[i][:30]!r}" if args.pair else ""
        shown = "  ".join(f"{s.label} {s.score:+.6f}" for s in scores)
        print(f"{text[:40]!r}{pair}: {shown}")
    return 0
