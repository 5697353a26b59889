# expect: ok
# stdout: most common: data (3)
from collections import Counter
from pathlib import Path

Path("article.txt").write_text("Data beats opinions. More data, better data models.", encoding="utf-8")
words = [w.strip(".,").lower() for w in Path("article.txt").read_text(encoding="utf-8").split()]
word, n = Counter(words).most_common(1)[0]
print(f"most common: {word} ({n})")
