# expect: ok
# stdout: 25 primes below 100
import math


def sieve(limit):
    is_prime = [True] * limit
    is_prime[0] = is_prime[1] = False
    for i in range(2, int(math.isqrt(limit)) + 1):
        if is_prime[i]:
            for j in range(i * i, limit, i):
                is_prime[j] = False
    return [i for i, p in enumerate(is_prime) if p]


primes = sieve(100)
print(f"{len(primes)} primes below 100")
primes[-5:]
