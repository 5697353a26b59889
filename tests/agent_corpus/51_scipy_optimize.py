# expect: ok
# stdout: minimum near x=2.0
from scipy.optimize import minimize

res = minimize(lambda x: (x[0] - 2) ** 2 + 1, x0=[0.0])
print(f"minimum near x={res.x[0]:.1f}")
