"""A token tree verified in one forward (tree speculation): its layout, attention mask and conv windows."""

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Tree:
    """A token tree verified in one forward. Node 0 is the committed token y; parents[i] < i (parents[0] = -1)."""

    parents: tuple[int, ...]

    @cached_property
    def depths(self) -> np.ndarray:
        d = np.zeros(len(self.parents), dtype=np.int32)
        for i, p in enumerate(self.parents[1:], start=1):
            d[i] = d[p] + 1
        return d

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def attention_mask(self, offset: int) -> mx.array:
        """[N, offset + N] bool: every node sees the committed context, its ancestors and itself."""
        n = len(self.parents)
        anc = np.zeros((n, n), dtype=bool)
        for i in range(n):
            anc[i, self.path(i)] = True
        return mx.array(np.concatenate([np.ones((n, offset), dtype=bool), anc], axis=1))

    def conv_windows(self, kernel: int) -> mx.array:
        """[N, K] indices into concat([conv_state (K-1 rows), node rows]): the last K inputs along each path."""
        rows = []
        for i in range(len(self.parents)):
            seq = list(range(kernel - 1)) + [kernel - 1 + j for j in self.path(i)]
            rows.append(seq[-kernel:])
        return mx.array(np.array(rows, dtype=np.int32))
