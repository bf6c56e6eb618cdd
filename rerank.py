"""`attnserve rerank`: rank texts against a query with a running server's reranker."""

import argparse
import sys

from attnserve.cli import texts_given
from attnserve.client import EncoderClient


def run_rerank(args: argparse.Namespace) -> int:
    texts = texts_given(args.texts, args.file)
    if not texts:
        print("attnserve rerank: give texts after the query, or --file", file=sys.stderr)
        return 2
    root = args.tls_ca.read_bytes() if args.tls_ca else None
    with EncoderClient(args.address, root_certificates=root) as client:
        results = client.rerank(args.query, texts, top_n=args.top_n, raw_scores=args.raw_scores,
                                truncate=args.truncate, model=args.model)
    for rank, result in enumerate(results, 1):
        print(f"{rank:>3}. {result.score:+.6f}  [{result.index}] {texts[result.index][:60]!r}")
    return 0
