# expect: ok
# file: chart.png
import pandas as pd
import matplotlib.pyplot as plt

df = pd.DataFrame({"year": [2020, 2021, 2022, 2023], "revenue": [1.2, 1.8, 2.5, 3.1]})
ax = df.plot(x="year", y="revenue", kind="bar", legend=False)
ax.set_ylabel("Revenue (M$)")
plt.savefig("chart.png", bbox_inches="tight")
print(df.to_string(index=False))
