# expect: ok
# stdout: 3 apple
import subprocess

with open("fruits.txt", "w") as f:
    f.write("apple\nbanana\napple\ncherry\napple\nbanana\n")
cmd = "sort fruits.txt | uniq -c | sort -rn | head -1"
print(subprocess.check_output(cmd, shell=True, text=True).strip())
