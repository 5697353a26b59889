# expect: ok
# stdout: done
import sys

print("done")
sys.exit()
