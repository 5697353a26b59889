# expect: ok
# stdout: found 3 csv files
import glob
import os

os.makedirs("data", exist_ok=True)
for i in range(3):
    with open(f"data/part{i}.csv", "w") as f:
        f.write("a,b\n1,2\n")
open("data/readme.md", "w").close()
files = sorted(glob.glob("data/*.csv"))
print(f"found {len(files)} csv files")
