# expect: ok
# stdout: report_2024.txt
import subprocess
from pathlib import Path

for name in ["report_2023.txt", "report_2024.txt", "notes.md"]:
    Path(name).write_text("x")
out = subprocess.run("ls -1 | grep 2024", shell=True, capture_output=True, text=True, check=True)
print(out.stdout.strip())
