# expect: ok
# stdout: east: 350.00
# stdout: west: 175.50
import csv
from collections import defaultdict

rows = [
    {"region": "east", "amount": "200"},
    {"region": "west", "amount": "175.5"},
    {"region": "east", "amount": "150"},
]
with open("sales.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=["region", "amount"])
    writer.writeheader()
    writer.writerows(rows)

totals = defaultdict(float)
with open("sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] += float(row["amount"])
for region, total in sorted(totals.items()):
    print(f"{region}: {total:.2f}")
