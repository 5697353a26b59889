# expect: ok
# stdout: elapsed ok
import time

start = time.perf_counter()
total = sum(range(1_000_000))
elapsed = time.perf_counter() - start
print("elapsed ok" if elapsed < 5 else "slow", total)
print(time.strftime("%Y"))
