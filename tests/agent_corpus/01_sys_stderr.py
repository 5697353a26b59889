# expect: ok
# stdout: processed 3 records
# stderr: warning: record 2 has no email
import sys

records = [{"id": 1, "email": "a@x.org"}, {"id": 2}, {"id": 3, "email": "c@x.org"}]
for r in records:
    if "email" not in r:
        print(f"warning: record {r['id']} has no email", file=sys.stderr)
print(f"processed {len(records)} records")
