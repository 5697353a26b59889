# expect: ok
# stdout: ['ERROR', 'ERROR']
# stdout: timeouts: 1
import re

log = """2024-01-01 10:00:00 INFO started
2024-01-01 10:00:05 ERROR connection timeout
2024-01-01 10:01:00 ERROR disk full
"""
levels = re.findall(r"^\S+ \S+ (ERROR)", log, re.MULTILINE)
print(levels)
print("timeouts:", len(re.findall(r"timeout", log)))
