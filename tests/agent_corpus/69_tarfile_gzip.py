# expect: ok
# stdout: restored: hello archive
import gzip
import os
import tarfile

with gzip.open("log.txt.gz", "wt") as f:
    f.write("hello archive")
with tarfile.open("bundle.tar.gz", "w:gz") as tar:
    tar.add("log.txt.gz")
os.remove("log.txt.gz")
with tarfile.open("bundle.tar.gz") as tar:
    tar.extractall("restored")
with gzip.open("restored/log.txt.gz", "rt") as f:
    print("restored:", f.read())
