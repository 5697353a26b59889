# expect: ok
# stdout: solution: [2. 3.]
import numpy as np

A = np.array([[3, 1], [1, 2]], dtype=float)
b = np.array([9, 8], dtype=float)
x = np.linalg.solve(A, b)
print("solution:", x)
print("eigenvalues:", np.round(np.linalg.eigvals(A), 3))
