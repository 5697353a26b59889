# expect: ok
# stdout: pairs summing to 10: [(3, 7), (4, 6)]
from itertools import combinations, groupby, chain

nums = [1, 3, 4, 6, 7]
pairs = [p for p in combinations(nums, 2) if sum(p) == 10]
print("pairs summing to 10:", pairs)
words = sorted(["apple", "avocado", "banana", "blueberry", "cherry"])
print({k: list(g) for k, g in groupby(words, key=lambda w: w[0])})
print(list(chain([1, 2], [3])))
