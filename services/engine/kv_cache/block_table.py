"""Block ids of every request holding blocks, as rows of one int64 array.

The KV cache manager keeps it beside its KVBlock lists and writes a row only when that request's
blocks change (a new block every block_size tokens, prefix hits at admission, the free at the
end), so a step gathers the scheduled requests' rows with one fancy index instead of rebuilding
a padded table from Python lists. Rows are recycled; a freed row is zeroed, so a row's padding
always reads block 0 (attention masks it by sequence length).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class BlockTable:
    def __init__(self, max_blocks_per_row: int, num_rows: int = 64) -> None:
        self._ids = np.zeros((num_rows, max_blocks_per_row), dtype=np.int64)  # [rows, max_blocks_per_row]
        self._counts = np.zeros(num_rows, dtype=np.int64)  # [rows]: blocks in each row
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: low rows first

    def append(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Add block_ids after the request's blocks (giving it a row if it has none)."""
        row = self._row_of.get(request_id)
        if row is None:
            row = self._row_of[request_id] = self._take_row()
        start = int(self._counts[row])
        end = start + len(block_ids)
        if end > self._ids.shape[1]:
            raise ValueError(f"request {request_id} would hold {end} blocks; rows hold {self._ids.shape[1]}")
        self._ids[row, start:end] = block_ids
        self._counts[row] = end

    def remove(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._ids[row, : self._counts[row]] = 0
            self._counts[row] = 0
            self._free_rows.append(row)

    def rows(self, request_ids: Iterable[str]) -> np.ndarray:
        """[n] int64: the row of each request (each must hold blocks)."""
        row_of = self._row_of
        return np.array([row_of[rid] for rid in request_ids], dtype=np.int64)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), most blocks of any of them] copy of those rows, padded with block 0."""
        if not len(rows):
            return self._ids[:0, :0].copy()
        width = int(self._counts[rows].max())
        return self._ids[rows, :width]

    def block_ids(self, request_id: str) -> list[int]:
        row = self._row_of.get(request_id)
        return [] if row is None else self._ids[row, : self._counts[row]].tolist()

    def _take_row(self) -> int:
        if not self._free_rows:  # double the rows; ids stay where they are
            num_rows = len(self._counts)
            self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
            self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free_rows.pop()
