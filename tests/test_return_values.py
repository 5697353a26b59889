"""The value of the last expression comes back as what the code meant (issue 21): a numpy
scalar as a number, a small array as lists, not as their repr."""

from __future__ import annotations

import pytest

from codecage import Sandbox

pytest.importorskip("numpy")

CASES = {
    "np.int64(8)": 8,
    "np.float64(1.5)": 1.5,
    "np.bool_(True)": True,
    "np.arange(3)": [0, 1, 2],
    "np.array([[1.5, 2.0], [3.0, 4.0]])": [[1.5, 2.0], [3.0, 4.0]],
    "np.int64(7) + 1": 8,
}


@pytest.mark.parametrize("expression", list(CASES))
def test_a_numpy_value_comes_back_as_plain_data(sandbox: Sandbox, expression: str) -> None:
    r = sandbox.run(f"import numpy as np\n{expression}")
    assert r.status == "ok", r.error
    assert r.return_value == CASES[expression]
    assert type(r.return_value) is type(CASES[expression])


def test_a_huge_array_and_a_nan_come_back_as_their_repr(sandbox: Sandbox) -> None:
    big = sandbox.run("import numpy as np\nnp.zeros(20_000)")
    nan = sandbox.run("import numpy as np\nnp.float64('nan')")
    assert isinstance(big.return_value, str) and big.return_value.startswith("array(")
    assert nan.return_value == "nan"
