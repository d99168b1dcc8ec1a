# SPDX-License-Identifier: Apache-2.0
"""Type aliases of kvpool's public annotations (py.typed). Typing only: nothing here is checked
at run time, and nothing imports torch (a torch.Tensor or stream is spelled Any)."""
from typing import Any, Optional, Sequence, Union

import numpy as np

# One integer, or a 1-D sequence / array of them (seq_ids, num_tokens: converted by np.asarray).
IntArray = Union[int, Sequence[int], np.ndarray]
# Token ids: sum(num_tokens) ints in batch order, or one sequence per row.
TokenIds = Union[Sequence[int], Sequence[Sequence[int]], np.ndarray]
# One salt for every row, or one per row (None or b"": none).
Salts = Union[bytes, bytearray, memoryview, Sequence[Optional[bytes]]]
# A NumPy array (host backend) or a torch.Tensor (cuda backend, or passed in by the caller).
Array = Any
# A torch.cuda.Stream, a raw cudaStream_t (int), or None (the current torch stream).
Stream = Any
