# expect: ok
# stdout: Order(id=1, items=['pen', 'ink'], total=7.5)
from dataclasses import dataclass, field, asdict
from typing import List, Optional


@dataclass
class Order:
    id: int
    items: List[str] = field(default_factory=list)
    total: float = 0.0
    note: Optional[str] = None

    def __repr__(self) -> str:
        return f"Order(id={self.id}, items={self.items}, total={self.total})"


o = Order(1, ["pen", "ink"], 7.5)
print(o)
print(asdict(o))
