"""How the study reports write their numbers: one formatter per kind of figure.

    percent(0.3451)             # '34.5%'
    percent(None)               # '-'  (not measured)
    percent(0.3451, unit="")    # '34.5' (a table whose header names the unit)
"""

from __future__ import annotations


def percent(x: float | None, unit: str = "%") -> str:
    """A share as a percentage to one decimal; '-' where it was not measured."""
    return "-" if x is None else f"{100 * x:.1f}{unit}"
