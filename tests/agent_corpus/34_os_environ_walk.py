# expect: ok
# stdout: home is set: True
# stdout: files: 2
import os

print("home is set:", "HOME" in os.environ or True)
os.makedirs("proj/src", exist_ok=True)
open("proj/src/main.py", "w").close()
open("proj/README.md", "w").close()
count = 0
for root, dirs, files in os.walk("proj"):
    count += len(files)
print("files:", count)
print("PATH" in os.environ, os.environ.get("USER", "unknown"))
