"""Sharded models (services/model/parallel.py) as the executor runs them: size 2 as two spawned
processes meeting at a TCPStore give the unsharded model's logits (tests/unit/model/test_tp_model.py
runs the ranks as threads)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tp_steps import TIMEOUT, assert_logits_match, run_rank


def _spawned_rank(rank: int, port: int, folders: dict[str, Path], out: Path) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    torch.save(run_rank(rank, store, (2,), folders), out / f"rank{rank}.pt")


def test_sharded_logits_match_in_spawned_processes(tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    """As the executor runs them: one process per rank, meeting at a TCPStore."""
    folders = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    mp.spawn(_spawned_rank, args=(store.port, folders, tmp_path), nprocs=2, join=True)
    assert_logits_match([torch.load(tmp_path / f"rank{r}.pt") for r in range(2)], folders, (2,))
