# expect: ok
# stdout: python 3.
import os
import platform
import sys

print(f"python {platform.python_version()} on {sys.platform}")
print("cpus:", os.cpu_count())
print("pid:", os.getpid())
