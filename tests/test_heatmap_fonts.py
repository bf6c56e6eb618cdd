"""`attnserve embed --heatmap` labels: a token the default font cannot draw (CJK) is drawn
with an installed font that has its glyphs, and where none has them, its characters are
written as code points (U+4E2D), never as empty boxes or placeholders. The fonts are
pointed at: a real TrueType font made here with fontTools, holding glyphs for two CJK
characters, or none, or matplotlib's placeholder font."""

import warnings
from pathlib import Path

import numpy as np
import pytest

from attnserve.embed import heatmap, tick_labels

CJK = "中心"
TOKENS = ["[CLS]", "中", "心", "b", "[SEP]"]


def cjk_font(path: Path) -> Path:
    """A TrueType font with a square glyph for each character of CJK (and none for Latin)."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    def square():
        pen = TTGlyphPen(None)
        pen.moveTo((100, 0))
        pen.lineTo((100, 800))
        pen.lineTo((900, 800))
        pen.lineTo((900, 0))
        pen.closePath()
        return pen.glyph()

    names = [".notdef", *(f"uni{ord(c):04X}" for c in CJK)]
    builder = FontBuilder(1000, isTTF=True)
    builder.setupGlyphOrder(names)
    builder.setupCharacterMap({ord(c): f"uni{ord(c):04X}" for c in CJK})
    builder.setupGlyf({name: square() for name in names})
    builder.setupHorizontalMetrics({name: (1000, 100) for name in names})
    builder.setupHorizontalHeader(ascent=880, descent=-120)
    builder.setupNameTable({"familyName": "Test CJK", "styleName": "Regular"})
    builder.setupOS2()
    builder.setupPost()
    builder.save(str(path))
    return path


def draw(path: Path, fonts: list[Path]):
    """The heatmap, and the warnings matplotlib gave while drawing it."""
    attention = np.full((len(TOKENS), len(TOKENS)), 1 / len(TOKENS), dtype=np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        labels = heatmap(path, attention, TOKENS, "layer 0, head 0", fonts=fonts)
    missing = [str(w.message) for w in caught if "missing from font" in str(w.message)]
    return labels, missing


def test_cjk_tokens_are_drawn_with_a_font_that_has_their_glyphs(tmp_path):
    font = cjk_font(tmp_path / "test-cjk.ttf")
    labels, missing = draw(tmp_path / "map.png", [font])
    assert [(label.text, label.font) for label in labels] == [
        ("[CLS]", None), ("中", font), ("心", font), ("b", None), ("[SEP]", None)]
    assert missing == []  # every glyph drawn: no empty boxes
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_such_a_font_the_labels_show_code_points(tmp_path):
    labels, missing = draw(tmp_path / "map.png", [])
    assert [label.text for label in labels] == ["[CLS]", "U+4E2D", "U+5FC3", "b", "[SEP]"]
    assert all(label.font is None for label in labels)
    assert missing == []
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_placeholder_font_does_not_count_as_having_the_glyphs():
    """matplotlib ships the Last Resort font, which maps every code point to a box naming
    its Unicode block: the label is escaped rather than drawn as that box."""
    import matplotlib

    last_resort = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "LastResortHE-Regular.ttf"
    if not last_resort.is_file():
        pytest.skip(f"this matplotlib ships no {last_resort.name}")
    assert [label.text for label in tick_labels(["中"], [last_resort])] == ["U+4E2D"]


@pytest.mark.parametrize("token", ["中a", "##心"])
def test_a_font_must_have_every_glyph_of_a_token(tmp_path, token):
    """The test font has no Latin glyphs: a mixed token is escaped, not half drawn."""
    (label,) = tick_labels([token], [cjk_font(tmp_path / "test-cjk.ttf")])
    assert label.font is None
    assert label.text == token.replace("中", "U+4E2D").replace("心", "U+5FC3")
