"""Import-time stub (P2P weight transfer), imported by miles'
backends/megatron_utils/update_weight/update_weight_from_distributed/p2p.py."""

from _import_stub import stub_function

initialize_fp4_gemm_config = stub_function(__name__, "initialize_fp4_gemm_config")
