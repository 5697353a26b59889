# expect: ok
# stdout: significant: True
from scipy import stats
import numpy as np

rng = np.random.default_rng(3)
a = rng.normal(0, 1, 200)
b = rng.normal(0.5, 1, 200)
t, p = stats.ttest_ind(a, b)
print(f"t={t:.3f} p={p:.2e}")
print("significant:", p < 0.05)
