"""Array comparisons for the worker scripts' ``CHECK`` lines (which need a bool, not an
assertion)."""

import numpy as np


def allclose(a, b, **tolerances) -> bool:
    """``np.allclose`` of arrays of equal shapes only (it broadcasts: a wrong shape could
    pass)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.allclose(a, b, **tolerances)
