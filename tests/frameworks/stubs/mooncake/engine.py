"""Stub of mooncake.engine: TransferEngine is imported by
miles/backends/megatron_utils/update_weight/update_weight_from_distributed/p2p_transfer_utils.py:11
(RDMA weight transfer)."""

from _import_stub import stub_class

TransferEngine = stub_class(__name__, "TransferEngine")
