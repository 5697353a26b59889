# expect: error exit=1
# stderr: config file missing
import os
import sys

if not os.path.exists("config.yaml"):
    print("error: config file missing", file=sys.stderr)
    sys.exit(1)
print("loaded")
