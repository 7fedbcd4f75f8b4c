"""Import-time stub (P2P weight transfer), imported by miles'
backends/megatron_utils/update_weight/update_weight_from_distributed/p2p.py."""

from _import_stub import stub_class

ParameterMapper = stub_class(__name__, "ParameterMapper")
