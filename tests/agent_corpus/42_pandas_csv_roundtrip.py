# expect: ok
# stdout: mean price: 12.5
import pandas as pd

df = pd.DataFrame({"product": ["a", "b", "c", "d"], "price": [10, 15, 12.5, 12.5]})
df.to_csv("products.csv", index=False)
loaded = pd.read_csv("products.csv")
print(f"mean price: {loaded['price'].mean()}")
print(loaded.describe())
