# expect: ok
# stdout: cwd=/workspace
# stdout: ['notes.txt']
import os

print(f"cwd={os.getcwd()}")
with open("notes.txt", "w") as f:
    f.write("hello\n")
print(sorted(os.listdir(".")))
