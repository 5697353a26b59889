# expect: ok
# stdout: top customer: acme
import os
import pandas as pd

os.makedirs("reports", exist_ok=True)
df = pd.DataFrame({
    "customer": ["acme", "globex", "acme", "initech", "globex"],
    "amount": [250.0, 100.0, 300.0, 50.0, 75.0],
})
totals = df.groupby("customer", as_index=False)["amount"].sum()
totals.to_json("reports/totals.json", orient="records")
top = totals.loc[totals["amount"].idxmax(), "customer"]
print("top customer:", top)
print(sorted(os.listdir("reports")))
