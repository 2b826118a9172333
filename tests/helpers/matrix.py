"""Encoding and kernel matrices: a few representative cases by default, every case with
`--all-cases` (tests/conftest.py).

Each case of a matrix compiles its own program (3 to 25 s on a CPU core). The representative
cases are chosen to cover the matrix's distinct code paths: each kernel, a bias (ALiBi), a
damping, and the headline and a higher-order Jordan encoding where the matrix holds them.
"""

import pytest


def cases(values, representative, quick=None):
    """`values` as pytest params: those not in `representative` marked `exhaustive` and, when
    `quick` is given, those not in it marked `slow`.

    values: scalars, or tuples for a parametrize of several names.
    """
    unknown = (set(representative) | set(quick or ())) - set(values)
    assert not unknown, f"cases not in the matrix: {sorted(unknown, key=str)}"
    params = []
    for value in values:
        marks = [] if value in representative else [pytest.mark.exhaustive]
        if quick is not None and value not in quick:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(*(value if isinstance(value, tuple) else (value,)), marks=marks))
    return params
