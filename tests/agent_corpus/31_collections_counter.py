# expect: ok
# stdout: [('the', 3), ('fox', 2)]
from collections import Counter, OrderedDict, deque

text = "the quick brown fox jumps over the lazy dog the fox"
counts = Counter(text.split())
print(counts.most_common(2))
window = deque(maxlen=3)
for w in text.split():
    window.append(w)
print(list(window))
