# expect: ok
# stdout: mean=
import numpy as np

rng = np.random.default_rng(0)
data = rng.normal(loc=50, scale=5, size=1000)
print(f"mean={data.mean():.2f} std={data.std():.2f}")
print("percentiles:", np.percentile(data, [25, 50, 75]).round(1))
