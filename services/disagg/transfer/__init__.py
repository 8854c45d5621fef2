"""Moving KV blocks from a prefill worker to a decode worker: one small interface (sender side /
receiver side), an in-process implementation for tests and torch.distributed pair groups for
everything else."""

from splitserve.services.disagg.transfer.base import (
    ChannelSpec,
    KVReceiver,
    KVSender,
    TransferError,
)

__all__ = ["ChannelSpec", "KVReceiver", "KVSender", "TransferError"]
