# expect: ok
# stdout: 3
import subprocess

with open("a.txt", "w") as f:
    f.write("one\ntwo\nthree\n")
result = subprocess.run("cat a.txt | wc -l", shell=True, capture_output=True, text=True)
print(result.stdout.strip())
