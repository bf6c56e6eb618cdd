"""`attnserve embed`: call a running server from the command line."""

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnserve.cli import texts_given
from attnserve.client import EmbeddingResult, EncoderClient


@dataclass(frozen=True)
class TickLabel:
    text: str
    """the token as drawn: itself, or with the characters no font has escaped (U+4E2D)"""
    font: Path | None
    """the font file that has every glyph of `text`, when the default font does not"""


def installed_fonts() -> list[Path]:
    """Every font file matplotlib knows, then every one on the system: fonts installed
    after matplotlib built its font cache (Debian's fonts-noto-cjk, say) count too."""
    from matplotlib import font_manager

    known = [Path(font.fname) for font in font_manager.fontManager.ttflist]
    return list(dict.fromkeys(known + [Path(f) for f in font_manager.findSystemFonts()]))


# Fonts that map every code point to a placeholder (a box naming its Unicode block), such
# as the Last Resort font matplotlib ships: they cover everything and draw nothing.
PLACEHOLDER_FAMILIES = ("Last Resort",)


@functools.cache
def _charmap(font: Path) -> frozenset[int]:
    """The code points `font` has real glyphs for."""
    from matplotlib.ft2font import FT2Font

    try:
        face = FT2Font(str(font))
    except (OSError, RuntimeError):  # not a font FreeType can read
        return frozenset()
    return frozenset() if face.family_name.startswith(PLACEHOLDER_FAMILIES) else frozenset(face.get_charmap())


def _covers(font: Path, text: str) -> bool:
    return set(map(ord, text)) <= _charmap(font)


def tick_labels(tokens: list[str], fonts: list[Path] | None = None) -> list[TickLabel]:
    """How each token is labelled. The default font (DejaVu Sans) has no CJK glyphs: a
    token it cannot draw gets the first of `fonts` (default: every installed font) that
    has all of its glyphs, and where none has them, each missing character is written as
    its code point, so the label says what the token is instead of showing empty boxes."""
    from matplotlib import font_manager, rcParams

    default = Path(font_manager.findfont(font_manager.FontProperties(family=rcParams["font.family"])))
    labels = []
    for token in tokens:
        if _covers(default, token):
            labels.append(TickLabel(token, None))
            continue
        fonts = installed_fonts() if fonts is None else fonts
        font = next((f for f in fonts if _covers(f, token)), None)
        labels.append(TickLabel(token, font) if font else TickLabel(
            "".join(c if _covers(default, c) else f"U+{ord(c):04X}" for c in token), None))
    return labels


def token_texts(text: str, tokens: list[str], offsets: list[int]) -> list[str]:
    """What each token of `text` stands for, to label it with: the characters it covers,
    not its vocabulary entry (a byte-level token such as 'Ġworld' shows its bytes'
    symbols, a metaspace one its '▁'), keeping WordPiece's '##' before a piece that
    continues a word; whitespace made visible ('␣', '\\n'); a special token ('<s>',
    '[CLS]'), which the tokenizer places at (0, 0), by its own name. `offsets`: start, end
    pairs flattened, as Tokenize returns them."""
    labels = []
    for token, start, end in zip(tokens, offsets[0::2], offsets[1::2], strict=True):
        covered = text[start:end]
        if start == end == 0:
            labels.append(token)
        elif not covered.strip():
            labels.append(covered.encode("unicode_escape").decode().replace(" ", "␣") or "␣")
        elif token.startswith("##") and not covered.strip().startswith("##"):
            labels.append("##" + covered.strip())
        else:
            labels.append(covered.strip())
    return labels


def heatmap(path: Path, attention: np.ndarray, tokens: list[str], title: str,
            fonts: list[Path] | None = None) -> list[TickLabel]:
    """Draw one attention map, query rows against key columns, each labelled with its
    token (see `tick_labels` for the fonts); returns the labels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.font_manager import FontProperties

    labels = tick_labels(tokens, fonts)
    size = max(4.0, 0.35 * len(tokens))
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(attention, cmap="viridis", vmin=0.0)
    texts = [label.text for label in labels]
    for ticks in (ax.set_xticks(range(len(labels)), texts, rotation=90),
                  ax.set_yticks(range(len(labels)), texts)):
        for tick, label in zip(ticks, labels, strict=True):
            if label.font is not None:
                tick.label1.set_fontproperties(FontProperties(fname=label.font,
                                                              size=tick.label1.get_fontsize()))
    ax.set(xlabel="key (attended to)", ylabel="query (attending)", title=title)
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return labels


def _vector_head(vector: np.ndarray) -> str:
    return " ".join(f"{x:+.4f}" for x in vector[:8])


def _chunks_out(args: argparse.Namespace, texts: list[str], results: list[EmbeddingResult]) -> int:
    """Each text's chunks: printed with their spans, or saved (--out) as an .npz of
    `vectors` [chunks, hidden], `spans` [chunks, 2] (code points, end exclusive),
    `text_index` and `num_tokens` [chunks]."""
    rows = [(i, c) for i, result in enumerate(results) for c in result.chunks]
    if args.out:
        vectors = np.stack([c.pooled for _, c in rows]) if rows else np.zeros((0, 0), np.float32)
        np.savez(args.out, vectors=vectors,
                 spans=np.asarray([(c.start, c.end) for _, c in rows], np.int64).reshape(-1, 2),
                 text_index=np.asarray([i for i, _ in rows], np.int64),
                 num_tokens=np.asarray([c.num_tokens for _, c in rows], np.int64))
        print(f"wrote {len(rows)} chunk vectors of {len(texts)} texts, with their spans, to {args.out}")
        return 0
    for text, result in zip(texts, results, strict=True):
        print(f"{text[:40]!r}: {result.num_tokens} tokens, {len(result.chunks)} chunks")
        for c in result.chunks:
            print(f"  [{c.start}:{c.end}] {c.num_tokens} tokens {text[c.start:c.end][:40]!r}: "
                  f"dim={c.pooled.size} [{_vector_head(c.pooled)} …]")
    return 0


# Flags of dense vectors that a sparse vector has no use for.
NOT_SPARSE = ("pooling", "normalize", "dimensions", "chunk_tokens", "attention", "heatmap")
SPARSE_SHOWN = 8
"""the largest weights printed of each text's sparse vector"""


def _sparse_out(args: argparse.Namespace, client: EncoderClient, texts: list[str]) -> int:
    """Each text's sparse vector: its largest weights printed, or saved (--out) as an .npz
    in compressed sparse row form, `indices`, `values` and `indptr` (text i's entries
    are indices[indptr[i]:indptr[i + 1]]), which scipy.sparse.csr_matrix takes as it is."""
    vectors = []
    for start in range(0, len(texts), args.batch_size):
        vectors += client.embed_sparse(texts[start:start + args.batch_size], top_k=args.top_k,
                                       truncate=args.truncate, truncation_direction=args.truncation_direction,
                                       prompt_name=args.prompt_name, model=args.model)
    if args.out:
        np.savez(args.out, indices=np.concatenate([v.indices for v in vectors]),
                 values=np.concatenate([v.values for v in vectors]),
                 indptr=np.cumsum([0] + [v.indices.size for v in vectors]))
        print(f"wrote {len(vectors)} sparse vectors to {args.out}")
        return 0
    for text, vector in zip(texts, vectors, strict=True):
        largest = np.argsort(-vector.values, kind="stable")[:SPARSE_SHOWN]
        shown = " ".join(f"{vector.indices[i]}:{vector.values[i]:.4f}" for i in largest)
        print(f"{text[:40]!r}: {vector.indices.size} non-zero [{shown}"
              + (" …]" if vector.indices.size > SPARSE_SHOWN else "]"))
    return 0


def run_embed(args: argparse.Namespace) -> int:
    texts = texts_given(args.texts, args.file) + [path.read_text() for path in args.document]
    if not texts:
        print("attnserve embed: give texts as arguments, --file or --document", file=sys.stderr)
        return 2
    defaults = {"pooling": "default", "normalize": False, "dimensions": 0}
    dense_flags = [f"--{name.replace('_', '-')}" for name in NOT_SPARSE
                   if getattr(args, name) not in (defaults.get(name), None, False)]
    if args.sparse and dense_flags:
        print(f"attnserve embed: --sparse takes no {', '.join(dense_flags)} (flags of dense "
              "vectors)", file=sys.stderr)
        return 2
    if args.top_k is not None and not args.sparse:
        print("attnserve embed: --top-k cuts a sparse vector: add --sparse", file=sys.stderr)
        return 2
    layers = args.layers if args.attention or args.heatmap is not None else None
    root = args.tls_ca.read_bytes() if args.tls_ca else None
    with EncoderClient(args.address, root_certificates=root) as client:
        if args.sparse:
            return _sparse_out(args, client, texts)
        results = []
        for start in range(0, len(texts), args.batch_size):
            batch = texts[start:start + args.batch_size]
            results += client.embed(batch, pooling=args.pooling, normalize=args.normalize, model=args.model,
                                    truncate=args.truncate, truncation_direction=args.truncation_direction,
                                    prompt_name=args.prompt_name, dimensions=args.dimensions,
                                    attention_layers=layers, attention_heads=args.heads,
                                    average_heads=args.average_heads, chunk_tokens=args.chunk_tokens,
                                    isolated=args.isolated, window_overlap=args.window_overlap)
            if args.file:
                done = min(start + args.batch_size, len(texts))
                bar = "#" * (30 * done // len(texts))
                print(f"\r[{bar:<30}] {done}/{len(texts)} texts", end="", file=sys.stderr)
        if args.file:
            print(file=sys.stderr)
        if args.heatmap:
            tokenized = client.tokenize(texts[:1], truncate=args.truncate, model=args.model,
                                        prompt_name=args.prompt_name,
                                        truncation_direction=args.truncation_direction)[0]
            info = client.model_info(args.model)
            # The offsets count from the prompt's first character.
            read = info.prompts.get(args.prompt_name or info.default_prompt_name, "") + texts[0]
    if args.chunk_tokens is not None:
        return _chunks_out(args, texts, results)
    pooled = [result.pooled for result in results if result.pooled is not None]
    if args.out:
        if pooled:
            np.save(args.out, np.stack(pooled))
            print(f"wrote {len(pooled)} embeddings to {args.out}")
    else:
        for text, result in zip(texts, results, strict=True):
            vector = result.pooled
            shown = "" if vector is None else _vector_head(vector)
            print(f"{text[:40]!r}: dim={0 if vector is None else vector.size} [{shown} …]"
                  + ("" if result.attentions is None else f" attentions={list(result.attentions.shape)}"))
    if args.heatmap:
        labels = token_texts(read, list(tokenized.tokens), list(tokenized.offsets))
        heatmap(args.heatmap, results[0].attentions[0, 0], labels, f"layer {(layers or [0])[0]}, "
                + ("heads averaged" if args.average_heads else f"head {(args.heads or [0])[0]}"))
        print(f"wrote attention heatmap to {args.heatmap}")
    return 0
