"""How a delta push names its entries, and the rule they follow (design.md section 5, qurl/wire/delta.py).

A delta push names a changed tensor X as "X@val" (the new elements, X's dtype) plus where they go: either "X@idx"
(strictly increasing flat int32 / int64 indices) or "X@mask" (uint8, one bit per flat element from element 0, least
significant bit first, as many bytes as reach the last change); tensors sent whole keep their name. qurl/wire/delta.py
builds and applies such pushes; this module sits below qurl/wire/protocol.py, whose WeightPush checks every push with
`check_entries`, so a decoded push has passed it. Needs only numpy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from qurl.wire.frames import BadField, WireTensor

DELTA_INDEX, DELTA_MASK, DELTA_VALUES = "@idx", "@mask", "@val"
INDEX_DTYPES = ("int32", "int64")


def check_entries(tensors: Mapping[str, WireTensor], mode: str) -> None:
    """Each X@val has one X@idx or X@mask that places exactly its values; indices rise from 0; X is not also whole."""
    parts = (DELTA_INDEX, DELTA_MASK, DELTA_VALUES)
    for name, t in tensors.items():
        if "@" not in name:
            continue
        base, _, part = name.rpartition("@")
        if mode != "delta":
            raise BadField(f"tensor {name}: '@' names are delta entries, and this push is {mode}")
        if not base or "@" + part not in parts:
            raise BadField(f"tensor {name}: a delta entry is named X{DELTA_INDEX}, X{DELTA_MASK} or X{DELTA_VALUES}")
        if base in tensors:
            raise BadField(f"tensor {base}: sent both whole and as a delta")
        if "@" + part != DELTA_VALUES:
            if base + DELTA_VALUES not in tensors:
                raise BadField(f"tensor {name}: its pair {base}{DELTA_VALUES} is missing")
            continue
        where = [base + p for p in (DELTA_INDEX, DELTA_MASK) if base + p in tensors]
        if len(where) != 1:
            raise BadField(
                f"tensor {name}: needs exactly one of its pairs {base}{DELTA_INDEX} or {base}{DELTA_MASK}, "
                f"got {len(where)}"
            )
        pos = tensors[where[0]]
        if t.data.ndim != 1 or pos.data.ndim != 1:
            raise BadField(
                f"tensor {base}: delta entries must be 1-D, got {list(pos.data.shape)} and {list(t.data.shape)}"
            )
        if where[0].endswith(DELTA_MASK):
            if pos.dtype != "uint8":
                raise BadField(f"tensor {base}: a delta mask is uint8, got {pos.dtype}")
            count = int(np.bitwise_count(pos.data).sum())
        else:
            if pos.dtype not in INDEX_DTYPES:
                raise BadField(f"tensor {base}: delta indices must be {' or '.join(INDEX_DTYPES)}, got {pos.dtype}")
            idx = pos.data
            if len(idx) and (idx[0] < 0 or not (np.diff(idx) > 0).all()):
                raise BadField(f"tensor {base}: delta indices must be >= 0 and strictly increasing")
            count = len(idx)
        if count != len(t.data):
            raise BadField(f"tensor {base}: the delta places {count} elements but carries {len(t.data)} values")
