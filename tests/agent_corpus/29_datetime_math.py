# expect: ok
# stdout: 2024-03-01 is a Friday
# stdout: days between: 60
from datetime import date, datetime, timedelta

d = date(2024, 3, 1)
print(f"{d.isoformat()} is a {d.strftime('%A')}")
start = datetime(2024, 1, 1)
end = start + timedelta(days=60)
print("days between:", (end - start).days)
