# expect: ok
# stdout: estimate of pi: 3.1
import random

random.seed(42)
n = 100_000
inside = sum(1 for _ in range(n) if random.random() ** 2 + random.random() ** 2 <= 1)
print(f"estimate of pi: {4 * inside / n:.4f}")
