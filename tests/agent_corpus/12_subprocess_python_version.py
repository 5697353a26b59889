# expect: ok
# stdout: Python 3
import subprocess
import sys

proc = subprocess.run([sys.executable, "--version"], capture_output=True, text=True)
print(proc.stdout.strip() or proc.stderr.strip())
