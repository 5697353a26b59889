# expect: ok
# stdout: Reading input.txt
import argparse
import sys

parser = argparse.ArgumentParser()
parser.add_argument("path", nargs="?", default="input.txt")
args = parser.parse_args()
print(f"Reading {args.path}", file=sys.stdout)
