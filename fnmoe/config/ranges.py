"""`Range`, the bounds of a number field stated once in its `Annotated` type, and the common
bounded types of the config fields (schema.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated


@dataclass(frozen=True)
class Range:
    """The values a number field takes, stated once in its `Annotated` type; check.py reads it
    (a float field must also be finite, with or without a range)."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v: float) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def __str__(self) -> str:
        if self.hi == math.inf:
            return f"{'>' if self.lo_open else '>='} {_number(self.lo)}"
        return f"in {'(' if self.lo_open else '['}{_number(self.lo)}, {_number(self.hi)}{')' if self.hi_open else ']'}"


def _number(v: float) -> str:
    """v as :g writes it, or whole where :g would round it (int64's bounds)."""
    short = f"{v:g}"
    return short if float(short) == v else str(v)


PositiveInt = Annotated[int, Range(0, lo_open=True)]
Count = Annotated[int, Range(0)]
"""an int >= 0"""
PositiveFloat = Annotated[float, Range(0, lo_open=True)]
NonNegativeFloat = Annotated[float, Range(0)]
INT64 = Range(-2**63, 2**63 - 1)
"""what every int field holds (types.py checks it): torch's and numpy's integers, and the C long long
torch.manual_seed takes, hold no more"""
