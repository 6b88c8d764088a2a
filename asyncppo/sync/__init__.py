"""Weight broadcast from the learner to running engines over a dedicated torch.distributed group.

``make_sync_group`` forms the group (learner = rank 0), ``WeightSender.push``/``push_async`` broadcast named tensors
in bounded buckets, ``WeightReceiver.receive`` gets them back, and ``receive_into_engine`` loads them into an
engine in layer-complete pieces. See docs/architecture.md, "Weight sync".
"""

from asyncppo.sync.broadcast import TransferStats, WeightReceiver, WeightSender, WeightSyncError
from asyncppo.sync.engine_load import (
    LayerGroupLoader,
    UnsupportedWeightSync,
    layer_group,
    receive_into_engine,
    tied_alias_name,
    vllm_reload_weights,
)
from asyncppo.sync.group import SyncGroup, SyncGroupError, backend_for, find_free_port, make_sync_group
from asyncppo.sync.layout import WeightSyncProtocolError

__all__ = [
    "LayerGroupLoader",
    "SyncGroup",
    "SyncGroupError",
    "TransferStats",
    "UnsupportedWeightSync",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncProtocolError",
    "backend_for",
    "find_free_port",
    "layer_group",
    "make_sync_group",
    "receive_into_engine",
    "tied_alias_name",
    "vllm_reload_weights",
]
