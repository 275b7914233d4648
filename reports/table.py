"""Text tables for the terminal: one header, a rule, left-aligned columns two spaces apart; and
how a score reads in them."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def score(value: float | None) -> str:
    """A pass rate to three places, or "-" when there is none."""
    return "-" if value is None else f"{value:.3f}"
