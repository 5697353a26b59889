# expect: ok
# stdout: 3 lines, 16 bytes
from pathlib import Path

out = Path("output") / "result.txt"
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text("alpha\nbeta\ngamma")
text = out.read_text()
print(f"{len(text.splitlines())} lines, {out.stat().st_size} bytes")
