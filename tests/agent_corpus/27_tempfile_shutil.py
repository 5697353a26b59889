# expect: ok
# stdout: copied: ['a.txt', 'b.txt']
import os
import shutil
import tempfile

src = tempfile.mkdtemp()
for name in ("a.txt", "b.txt"):
    with open(os.path.join(src, name), "w") as f:
        f.write(name)
shutil.copytree(src, "backup")
print("copied:", sorted(os.listdir("backup")))
shutil.rmtree(src)
