# expect: ok
# stdout: North    250
import pandas as pd

df = pd.DataFrame({
    "region": ["North", "South", "North", "East"],
    "sales": [100, 80, 150, 60],
})
summary = df.groupby("region")["sales"].sum().sort_values(ascending=False)
print(summary)
