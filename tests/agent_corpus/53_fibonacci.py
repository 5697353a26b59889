# expect: ok
# stdout: fib(30) = 832040
from functools import lru_cache


@lru_cache(maxsize=None)
def fib(n: int) -> int:
    return n if n < 2 else fib(n - 1) + fib(n - 2)


print(f"fib(30) = {fib(30)}")
