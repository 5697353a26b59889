# expect: ok
# stdout: 2024-01
import numpy as np
import pandas as pd

idx = pd.date_range("2024-01-01", periods=90, freq="D")
ts = pd.Series(np.arange(90), index=idx)
monthly = ts.resample("MS").sum()
for month, value in monthly.items():
    print(month.strftime("%Y-%m"), value)
