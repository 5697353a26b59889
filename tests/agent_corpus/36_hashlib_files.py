# expect: ok
# stdout: sha256 of file matches: True
import hashlib
from pathlib import Path

p = Path("blob.bin")
p.write_bytes(b"some binary content" * 100)
h1 = hashlib.sha256(p.read_bytes()).hexdigest()
h = hashlib.sha256()
with p.open("rb") as f:
    for chunk in iter(lambda: f.read(64), b""):
        h.update(chunk)
print("sha256 of file matches:", h.hexdigest() == h1)
