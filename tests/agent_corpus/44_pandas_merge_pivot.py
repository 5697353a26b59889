# expect: ok
# stdout: Widget
import pandas as pd

orders = pd.DataFrame({"order_id": [1, 2, 3, 4], "product_id": [10, 20, 10, 30], "qty": [2, 1, 5, 3]})
products = pd.DataFrame({"product_id": [10, 20, 30], "name": ["Widget", "Gadget", "Doohickey"]})
merged = orders.merge(products, on="product_id", how="left")
pivot = merged.pivot_table(index="name", values="qty", aggfunc="sum")
print(pivot.sort_values("qty", ascending=False).head())
