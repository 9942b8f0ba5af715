"""matplotlib for the benches' PNGs, headless; None (with a note) when it is not installed."""

from __future__ import annotations


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed (pip install matplotlib): no plot written")
        return None
    return plt
