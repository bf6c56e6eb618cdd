"""matplotlib, set up once for every benchmark: no display (Agg), and the figure saved to
the path the runner gives (bench/results/NAME/NAME.png) and closed.

    with figure(path, 1, 2, figsize=(10, 4)) as (fig, (left, right)):
        left.bar(...)
"""

from contextlib import contextmanager
from pathlib import Path


@contextmanager
def figure(path: Path, *grid: int, dpi: int = 120, **subplots):
    """(figure, axes) as plt.subplots(*grid, **subplots) makes them; saved on leaving."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
