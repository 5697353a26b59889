# expect: ok
# stdout: 0.30
# stdout: 1/3
from decimal import Decimal, ROUND_HALF_UP
from fractions import Fraction

print((Decimal("0.1") + Decimal("0.2")).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))
print(Fraction(1, 6) + Fraction(1, 6))
