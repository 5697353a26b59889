# expect: ok
# stdout: hello from the shell
import os

status = os.system("echo hello from the shell")
print("exit status", status)
