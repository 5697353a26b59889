"""An agent-written analysis, as codecage runs it: standard library only, files in /workspace.

The agent writes a CSV of (synthetic) sales, aggregates it per region, saves a report
next to it, and returns a small summary as the value of the last expression.
"""

import csv
import json
import random
import statistics
from collections import defaultdict

random.seed(7)
regions = ["north", "south", "east", "west"]
with open("sales.csv", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["region", "units", "price"])
    for _ in range(5000):
        writer.writerow(
            [random.choice(regions), random.randint(1, 20), round(random.uniform(2, 50), 2)]
        )

revenue = defaultdict(list)
with open("sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        revenue[row["region"]].append(int(row["units"]) * float(row["price"]))

report = {
    region: {"orders": len(v), "total": round(sum(v), 2), "median": round(statistics.median(v), 2)}
    for region, v in sorted(revenue.items())
}
with open("report.json", "w") as f:
    json.dump(report, f, indent=2)

for region, stats in report.items():
    print(f"{region:<6} {stats['orders']:>5} orders  {stats['total']:>12,.2f} total")

best = max(report, key=lambda r: report[r]["total"])
{"best_region": best, "total_revenue": round(sum(s["total"] for s in report.values()), 2)}
