"""Import-time stub (P2P weight transfer), imported by miles'
backends/megatron_utils/update_weight/update_weight_from_distributed/p2p.py.

miles/backends/megatron_utils/sglang.py imports further fp8 helpers inside try/except
ImportError; they are left out on purpose, so miles takes its own "not available" branch.
"""

from _import_stub import stub_function

initialize_fp8_gemm_config = stub_function(__name__, "initialize_fp8_gemm_config")

# miles d2c771bb5 (2026-06): megatron_to_hf/processors/quantizer_mxfp8.py falls back to it,
# unguarded, when flashinfer is missing (always on CPU); the actor imports that module. On
# that tree sglang.py's guarded import then finds this stub, which raises if ever called.
mxfp8_group_quantize = stub_function(__name__, "mxfp8_group_quantize")
