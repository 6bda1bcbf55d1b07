"""Tensor parallelism: groups and the in-order agreement of tree-shaping decisions."""

from aiocache_kv.distributed.acks import AckQueue
from aiocache_kv.distributed.agreement import AgreementError, Request, Sequencer
from aiocache_kv.distributed.group import SingleRank, TorchTPGroup, TPGroup

__all__ = [
    "AckQueue",
    "AgreementError",
    "Request",
    "Sequencer",
    "SingleRank",
    "TPGroup",
    "TorchTPGroup",
]
