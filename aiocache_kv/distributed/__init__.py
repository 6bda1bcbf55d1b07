"""Tensor parallelism: groups and the in-order agreement of tree-shaping decisions."""

from aiocache_kv.distributed.acks import AckQueue
from aiocache_kv.distributed.agreement import Request, Sequencer
from aiocache_kv.distributed.group import SingleRank, TorchTPGroup, TPGroup
from aiocache_kv.errors import AgreementError

__all__ = [
    "AckQueue",
    "AgreementError",
    "Request",
    "Sequencer",
    "SingleRank",
    "TPGroup",
    "TorchTPGroup",
]
