# expect: ok
# file: histogram.png
import matplotlib.pyplot as plt
import numpy as np

values = np.random.default_rng(1).exponential(2.0, 500)
fig, ax = plt.subplots()
ax.hist(values, bins=30, color="steelblue")
ax.set_title("Distribution")
fig.savefig("histogram.png", dpi=100)
plt.close(fig)
print("ok")
