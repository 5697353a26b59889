# expect: ok
# stdout: 2 data.txt
import subprocess

with open("data.txt", "w") as f:
    f.write("x\ny\n")
out = subprocess.check_output(["wc", "-l", "data.txt"], text=True)
print(out.strip())
