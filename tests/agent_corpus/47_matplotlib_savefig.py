# expect: ok
# stdout: Saved plot to sales.png
# file: sales.png
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

months = ["Jan", "Feb", "Mar", "Apr"]
sales = [120, 135, 150, 160]
plt.figure(figsize=(6, 4))
plt.plot(months, sales, marker="o")
plt.title("Monthly sales")
plt.xlabel("Month")
plt.ylabel("Sales")
plt.tight_layout()
plt.savefig("sales.png")
print("Saved plot to sales.png")
