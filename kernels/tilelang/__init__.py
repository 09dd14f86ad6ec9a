"""TileLang (Hopper) implementations behind ``functional_dsv41.kernels`` (one op per file, ``<op>_tl.py``).

Exported names are the ops of ``kernels.OPS`` that have a TileLang implementation, with the
signatures of ``kernels/reference.py``; ``kernels._tilelang_op`` finds them here. Ops not exported
fall back to torch under ``impl="auto"``.
"""
from .act_quant_tl import act_quant
from .fp4_gemm_tl import fp4_gemm, fp4_gemm_grouped
from .fp4_quant_tl import fp4_act_quant
from .fp8_gemm_tl import fp8_gemm
from .hc_apply_tl import hc_post, hc_pre
from .hc_sinkhorn_tl import hc_split_sinkhorn
from .index_topk_tl import index_candidates, index_topk
from .indexer_tl import index_scores
from .sparse_attn_tl import sparse_attn

__all__ = ["act_quant", "fp4_act_quant", "fp4_gemm", "fp4_gemm_grouped", "fp8_gemm", "hc_split_sinkhorn", "hc_pre", "hc_post",
           "sparse_attn",
           "index_scores", "index_topk", "index_candidates"]
