# expect: ok
# stdout: area total: 27.57
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Iterable


class Shape(ABC):
    @abstractmethod
    def area(self) -> float: ...


class Circle(Shape):
    def __init__(self, r: float) -> None:
        self.r = r

    def area(self) -> float:
        return math.pi * self.r ** 2


class Rect(Shape):
    def __init__(self, w: float, h: float) -> None:
        self.w, self.h = w, h

    def area(self) -> float:
        return self.w * self.h


def total_area(shapes: Iterable[Shape]) -> float:
    return sum(s.area() for s in shapes)


print(f"area total: {total_area([Circle(2), Rect(3, 5)]):.2f}")
