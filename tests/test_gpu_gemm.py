"""TileLang fp8 and fp4 GEMMs against the torch reference (SPEC §10; issue #7). GPU only: tests/conftest.py skips
them without CUDA. Outputs within one bf16 ulp of the reference on all but 1e-4 of the elements.
"""
import pytest
import torch

from functional_dsv41 import kernels as K
from functional_dsv41 import quant as Q

from conftest import cosine_diff
from gpu_common import DEV, close_bf16 as _close_bf16, need_tilelang as _need_tilelang

pytestmark = pytest.mark.gpu


# ----------------------------------------------------------------------------- fp8 GEMM
GEMM_SHAPES = [(5, 70, 96), (128, 2304, 5120), (300, 5120, 2304), (4096, 5120, 5120)]


def _fp8_operands(M, N, K, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(M, K, device=DEV, generator=g) *
         torch.exp2(torch.randint(-4, 5, (M, K // 32), device=DEV, generator=g).float()).repeat_interleave(32, 1))
    a, a_s = Q.act_quant(x.bfloat16(), 32, "ue8m0", Q.E8M0)
    # a power of two per 32 x 32 block (2^-10 .. 2^-4): the weight scales differ block to block, so a mis-indexed
    # B scale changes the product (with one global scale, 25568 of 25600 blocks at 5120^2 shared one scale)
    blk = torch.exp2(torch.randint(-10, -3, (-(-N // 32), K // 32), device=DEV, generator=g).float())
    w = torch.randn(N, K, device=DEV, generator=g) * blk.repeat_interleave(32, 0)[:N].repeat_interleave(32, 1)
    b, b_s = Q.quant_fp8_block(w)
    return a, a_s, b, b_s


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm(shape):
    _need_tilelang()
    a, a_s, b, b_s = _fp8_operands(*shape)
    c = K.fp8_gemm(a, a_s, b, b_s, impl="tilelang")
    ref = K.fp8_gemm(a, a_s, b, b_s, impl="torch")
    assert c.dtype == torch.bfloat16 and c.shape == ref.shape
    assert cosine_diff(c, ref) < 1e-5
    nbad, mx = _close_bf16(c, ref, ulps=2)          # 2 * 2^-8 relative = one bf16 ulp at worst
    assert nbad <= c.numel() * 1e-4, (nbad, mx)


# Configurations the bench sweeps; all must match like the default (BN=192, sync promotion; one main loop
# since run 10, the v1 loop / v3 ping-pong / fp4 byte conversion were removed).
# fp8: kernel "pingpong" (default where K % 128 == 0) and "loop" (any K multiple of 32)
# "ws" (K % 128 == 0): the warp-specialised kernel without turn-taking, BM = 64 * consumers (192 by default, so
# M = 300 / 1000 leave a partial row block); persistent=132 = the H200's SM count (as the bench compiles it).
FP8_WS_DT = dict(kernel="ws", consumers=2, double_tmp=True, nreg=(240, 24), stages=4)
# cluster=2: 2-CTA clusters along N sharing the A tile by TMA multicast (needs ceil(N/BN) even: 2304/128 = 18,
# 5120/128 = 40; the 70-column shape has K = 96 and is refused for K first).
FP8_WS_CLUSTER = [dict(kernel="ws", cluster=2), dict(kernel="ws", consumers=2, BN=128, nreg=(240, 24), cluster=2)]
FP8_CFGS = [dict(kernel="loop"), dict(kernel="loop", BN=128, async_promote=True), dict(kernel="pingpong", BN=128),
            dict(kernel="ws"), FP8_WS_DT] + FP8_WS_CLUSTER
FP8_WIDE_CFGS = [dict(kernel="loop", stages=3),
                 dict(kernel="loop", async_promote=False, BN=128, BM=192, threads=384),
                 dict(kernel="loop", async_promote=True, BN=128, BK=256, stages=3),
                 dict(kernel="pingpong", stages=3),
                 dict(kernel="ws", stages=4), dict(kernel="ws", stages=5), dict(kernel="ws", store="direct"),
                 dict(kernel="ws", stages=4, persistent=132),
                 dict(kernel="ws", consumers=2, double_tmp=True, nreg=(240, 24), BK=256),
                 dict(FP8_WS_DT, persistent=132),
                 dict(kernel="ws", consumers=2, BN=192, nreg=(240, 24)),
                 dict(kernel="ws", BN=96, double_tmp=True, stages=4), dict(kernel="ws", BK=256, stages=2)]
FP8_WS_RELEASE_CFGS = [dict(kernel="ws"), dict(kernel="ws", stages=4), dict(kernel="ws", stages=4, persistent=132),
                       FP8_WS_DT, dict(FP8_WS_DT, persistent=132)] + FP8_WS_CLUSTER
FP4_CFGS = [dict(BN=128, async_promote=False), dict(BN=128, async_promote=True)]
FP4_WIDE_CFGS = [dict(BN=128, BM=192, threads=384), dict(BN=192, stages=4)]
_cfg_id = lambda c: ",".join(f"{k}={v}" for k, v in c.items())


def _check_close(c, ref, what):
    assert c.dtype == torch.bfloat16 and c.shape == ref.shape
    cd = cosine_diff(c, ref)
    nbad, mx = _close_bf16(c, ref, ulps=2)          # 2 * 2^-8 relative = one bf16 ulp at worst
    print(f"{what}: cosine diff {cd:.2e}, beyond 1 ulp {nbad}/{c.numel()}, max abs {mx:.3e}")
    assert cd < 1e-5
    assert nbad <= c.numel() * 1e-4, (nbad, mx)


@pytest.mark.parametrize("cfg", FP8_CFGS, ids=_cfg_id)
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_cfg(shape, cfg):
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    a, a_s, b, b_s = _fp8_operands(*shape)
    if cfg.get("kernel") in ("pingpong", "ws") and shape[2] % 128:
        with pytest.raises(ValueError, match="multiples of 128"):       # TMA scale tiles: K % 128 == 0
            fg.fp8_gemm(a, a_s, b, b_s, **cfg)
        return
    _check_close(fg.fp8_gemm(a, a_s, b, b_s, **cfg), K.fp8_gemm(a, a_s, b, b_s, impl="torch"), f"fp8 {shape} {cfg}")


@pytest.mark.parametrize("cfg", FP8_WIDE_CFGS, ids=_cfg_id)
@pytest.mark.parametrize("shape", [(300, 5120, 2304), (4096, 5120, 5120)], ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_wide(shape, cfg):
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    a, a_s, b, b_s = _fp8_operands(*shape)
    _check_close(fg.fp8_gemm(a, a_s, b, b_s, **cfg), K.fp8_gemm(a, a_s, b, b_s, impl="torch"), f"fp8 {shape} {cfg}")


@pytest.mark.parametrize("cfg", FP8_WS_RELEASE_CFGS, ids=_cfg_id)
@pytest.mark.parametrize("shape", [(1000, 5120, 5120), (4096, 2304, 5120), (4096, 5120, 2304)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_ws_release(shape, cfg):
    """The ws kernel at the release's shapes (and 1000 rows: a partial 192-row block, masked stores)."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    a, a_s, b, b_s = _fp8_operands(*shape, seed=2)
    _check_close(fg.fp8_gemm(a, a_s, b, b_s, **cfg), K.fp8_gemm(a, a_s, b, b_s, impl="torch"), f"fp8 {shape} {cfg}")


# swizzle128: the A/B stage tiles in one 128-byte-swizzled layout (one TMA box per tile, each k = 32 WGMMA's
# descriptor 32 bytes into the swizzle atom) instead of TileLang's four 32-byte-swizzled panels. Same WGMMAs in the
# same order, so the output must be BITWISE equal to the default layout's; and close to the torch reference.
FP8_SW128_CFGS = [dict(kernel="pingpong"), dict(kernel="pingpong", BN=128), dict(kernel="ws"),
                  dict(kernel="ws", cluster=2), FP8_WS_DT, dict(kernel="loop"),
                  dict(kernel="loop", BN=128, async_promote=True)]


@pytest.mark.parametrize("cfg", FP8_SW128_CFGS, ids=_cfg_id)
@pytest.mark.parametrize("shape", [(300, 5120, 2304), (1000, 2304, 5120), (4096, 5120, 5120)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_swizzle128_bitwise_equal(shape, cfg):
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    a, a_s, b, b_s = _fp8_operands(*shape, seed=3)
    c128 = fg.fp8_gemm(a, a_s, b, b_s, **cfg, swizzle128=True)
    c = fg.fp8_gemm(a, a_s, b, b_s, **cfg, swizzle128=False)
    assert torch.equal(c128, c), f"swizzle128 differs from the narrow layout at {int((c128 != c).sum())} elements"
    _check_close(c128, K.fp8_gemm(a, a_s, b, b_s, impl="torch"), f"fp8 swizzle128 {shape} {cfg}")


def test_swizzle128_layout_in_generated_code():
    """The layout switch reaches the generated CUDA: 128-byte-swizzle WGMMA descriptors (layout type 1) advanced
    32 bytes per k = 32 slice, one TMA box per operand tile (the default at BK = 128); without it, 32-byte swizzle
    (type 3) panels."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    src = fg.fp8_gemm_pingpong_kernel(5120, 5120).get_kernel_source()
    assert "initialize_wgmma_descriptor<1, 1, 64>" in src and "(kk * 32)" in src
    assert "initialize_wgmma_descriptor<3," not in src
    assert src.count("tma_load(A_desc") == 1 and src.count("tma_load(Bm_desc") == 1
    src0 = fg.fp8_gemm_pingpong_kernel(5120, 5120, swizzle128=False).get_kernel_source()
    assert "initialize_wgmma_descriptor<3, 1, 16>" in src0


def test_fp8_gemm_ws_cluster_needs_even_column_blocks():
    """cluster=2 pairs column blocks 2c, 2c + 1: BN=192 at N=5120 (27 blocks) and a persistent grid are refused
    before compiling."""
    from functional_dsv41.kernels.tilelang import fp8_gemm_ws_tl as fw
    with pytest.raises(ValueError, match="even number of column blocks"):
        fw.fp8_gemm_ws_kernel(5120, 5120, consumers=2, BN=192, nreg=(240, 24), cluster=2)
    with pytest.raises(ValueError, match="without a persistent grid"):
        fw.fp8_gemm_ws_kernel(5120, 5120, stages=4, persistent=132, cluster=2)


def test_fp8_gemm_leading_dims():
    _need_tilelang()
    a, a_s, b, b_s = _fp8_operands(6, 256, 512, seed=1)
    a3, s3 = a.view(2, 3, 512), a_s.view(2, 3, 16)
    c = K.fp8_gemm(a3, s3, b, b_s, impl="tilelang")
    assert c.shape == (2, 3, 256)
    assert cosine_diff(c, K.fp8_gemm(a3, s3, b, b_s, impl="torch")) < 1e-5


def test_fp8_gemm_block_size_64_falls_back_under_auto():
    """The kernels tile 32 x 32 scale blocks only: block_size 64 raised NotImplementedError through impl="auto";
    it is ``Unsupported`` now, so auto runs the torch op (and impl="tilelang" still refuses)."""
    _need_tilelang()
    g = torch.Generator(device=DEV).manual_seed(0)
    a, a_s = Q.act_quant(torch.randn(3, 128, device=DEV, generator=g).bfloat16(), 64, "ue8m0", Q.E8M0)
    b = Q.quant_fp8_block(torch.randn(64, 128, device=DEV, generator=g))[0]
    b_s = Q.float_to_e8m0(torch.tensor([[0.5, 0.25]], device=DEV))
    ref = K.fp8_gemm(a, a_s, b, b_s, block_size=64, impl="torch")
    assert torch.equal(K.fp8_gemm(a, a_s, b, b_s, block_size=64, impl="auto"), ref)
    with pytest.raises(K.Unsupported, match="block_size 32 only"):
        K.fp8_gemm(a, a_s, b, b_s, block_size=64, impl="tilelang")



# ----------------------------------------------------------------------------- fp4 GEMM (fp8 act x fp4 weight)
FP4_GEMM_SHAPES = [(5, 70, 96), (128, 2304, 5120), (300, 5120, 2304), (4096, 2304, 5120), (4096, 5120, 2304)]


def _fp4_gemm_operands(M, N, K, seed=0, act_block=32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(M, K, device=DEV, generator=g) *
         torch.exp2(torch.randint(-4, 5, (M, K // 32), device=DEV, generator=g).float()).repeat_interleave(32, 1))
    a, a_s = Q.act_quant(x.bfloat16(), act_block, "ue8m0", Q.E8M0)
    w = (torch.randn(N, K, device=DEV, generator=g) * 0.02 *
         torch.exp2(torch.randint(-3, 4, (N, K // 32), device=DEV, generator=g).float()).repeat_interleave(32, 1))
    b, b_s = Q.quant_fp4(w)
    return a, a_s, b, b_s


@pytest.mark.parametrize("shape", FP4_GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp4_gemm(shape):
    _need_tilelang()
    a, a_s, b, b_s = _fp4_gemm_operands(*shape)
    c = K.fp4_gemm(a, a_s, b, b_s, impl="tilelang")
    ref = K.fp4_gemm(a, a_s, b, b_s, impl="torch")
    assert c.dtype == torch.bfloat16 and c.shape == ref.shape
    cd = cosine_diff(c, ref)
    nbad, mx = _close_bf16(c, ref, ulps=2)          # 2 * 2^-8 relative = one bf16 ulp at worst
    print(f"fp4_gemm {shape}: cosine diff {cd:.2e}, beyond 1 ulp {nbad}/{c.numel()}, max abs {mx:.3e}")
    assert cd < 1e-5
    assert nbad <= c.numel() * 1e-4, (nbad, mx)


@pytest.mark.parametrize("cfg", FP4_CFGS, ids=_cfg_id)
@pytest.mark.parametrize("shape", FP4_GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp4_gemm_cfg(shape, cfg):
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    a, a_s, b, b_s = _fp4_gemm_operands(*shape)
    _check_close(f4.fp4_gemm(a, a_s, b, b_s, **cfg), K.fp4_gemm(a, a_s, b, b_s, impl="torch"), f"fp4 {shape} {cfg}")


@pytest.mark.parametrize("cfg", FP4_WIDE_CFGS, ids=_cfg_id)
@pytest.mark.parametrize("shape", [(300, 5120, 2304), (4096, 2304, 5120)], ids=lambda s: "x".join(map(str, s)))
def test_fp4_gemm_wide(shape, cfg):
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    a, a_s, b, b_s = _fp4_gemm_operands(*shape)
    _check_close(f4.fp4_gemm(a, a_s, b, b_s, **cfg), K.fp4_gemm(a, a_s, b, b_s, impl="torch"), f"fp4 {shape} {cfg}")


@pytest.mark.parametrize("cfg", [dict(kernel="loop"), dict(BN=128, async_promote=True)], ids=_cfg_id)
@pytest.mark.parametrize("shape", [(300, 5120, 2304), (1000, 2304, 5120)], ids=lambda s: "x".join(map(str, s)))
def test_fp4_gemm_swizzle128_bitwise_equal(shape, cfg):
    """The converted e4m3 B tile and the A tile 128-byte swizzled (the threads' fp4 -> e4m3 stores follow the
    layout): bitwise the default layout's output."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    a, a_s, b, b_s = _fp4_gemm_operands(*shape, seed=3)
    c128 = f4.fp4_gemm(a, a_s, b, b_s, **cfg, swizzle128=True)
    assert torch.equal(c128, f4.fp4_gemm(a, a_s, b, b_s, **cfg, swizzle128=False))
    _check_close(c128, K.fp4_gemm(a, a_s, b, b_s, impl="torch"), f"fp4 swizzle128 {shape} {cfg}")


@pytest.mark.parametrize("rows,K", [(70, 96), (300, 2304), (1000, 5120)])
def test_dequant_bf16_exact(rows, K):
    """The bf16 path's operands: e4m3 activations x per-32 scales, e4m3 weights x 32x32 block scales, packed e2m1
    weights x per-32 scales, each bitwise equal to quant's torch dequantisation (every value is a bf16)."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang._gemm import dequant_bf16
    a, a_s, b, b_s = _fp8_operands(rows, rows, K, seed=4)
    want_a = (a.float() * Q.e8m0_to_float(a_s).repeat_interleave(32, -1)).bfloat16()
    assert torch.equal(dequant_bf16(a, a_s, "e4m3"), want_a)
    assert torch.equal(dequant_bf16(b, b_s, "e4m3", row_rep=32), Q.dequant_fp8_block(b, b_s))
    _, _, b4, b4_s = _fp4_gemm_operands(rows, rows, K, seed=4)
    assert torch.equal(dequant_bf16(b4, b4_s, "e2m1"), Q.dequant_fp4(b4, b4_s))


@pytest.mark.parametrize("shape", [(5, 70, 96), (300, 5120, 2304), (1000, 2304, 5120)],
                         ids=lambda s: "x".join(map(str, s)))
def test_block_scaled_gemms_bf16_path(shape):
    """kernel="bf16": exact bf16 operands, then torch's bf16 matmul (fp32 accumulation in another order than the
    reference's per-block sums): within the same bounds as the block-scaled kernels, fp8 and fp4 weights."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    a, a_s, b, b_s = _fp8_operands(*shape, seed=5)
    _check_close(fg.fp8_gemm(a, a_s, b, b_s, kernel="bf16"), K.fp8_gemm(a, a_s, b, b_s, impl="torch"),
                 f"fp8 bf16 path {shape}")
    a, a_s, b, b_s = _fp4_gemm_operands(*shape, seed=5)
    _check_close(f4.fp4_gemm(a, a_s, b, b_s, kernel="bf16"), K.fp4_gemm(a, a_s, b, b_s, impl="torch"),
                 f"fp4 bf16 path {shape}")


def test_fp4_gemm_leading_dims_act_block128():
    _need_tilelang()
    a, a_s, b, b_s = _fp4_gemm_operands(6, 256, 512, seed=1, act_block=128)
    a3, s3 = a.view(2, 3, 512), a_s.view(2, 3, 4)
    c = K.fp4_gemm(a3, s3, b, b_s, act_block_size=128, impl="tilelang")
    ref = K.fp4_gemm(a3, s3, b, b_s, act_block_size=128, impl="torch")
    assert c.shape == (2, 3, 256)
    assert cosine_diff(c, ref) < 1e-5
    assert _close_bf16(c, ref, ulps=2)[0] <= 1


def test_auto_picks_tilelang_fp4_gemm():
    _need_tilelang()
    from functional_dsv41.kernels import tilelang as tl
    assert K.resolve("fp4_gemm", "auto", on_cuda=True) is tl.fp4_gemm


def test_default_config_by_rows():
    """With no options the wrappers pick by shape: fp8 the first small-tile loop whose grid fits one wave of the
    SMs, else the halves kernel (the loop where K % 128); fp4 the bf16 path from BF16_MIN_M rows, the block-scaled
    loop below. Each pick is checked by value (bitwise the explicitly named kernel's output) and against the
    torch reference."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    bn64, bn128 = fg.SMALL_CFGS
    assert fg.default_config(64, 5120, 5120) == bn64            # 80 CTAs
    assert fg.default_config(128, 5120, 5120) == bn128          # 160 at BN 64, 80 at BN 128
    assert fg.default_config(128, 2304, 5120) == bn64           # 72
    assert fg.default_config(256, 2304, 5120) == bn128          # 144, 72
    assert fg.default_config(256, 5120, 5120) == dict(kernel="halves")
    assert fg.default_config(512, 2304, 96) == dict(kernel="loop")
    assert f4.default_config(f4.BF16_MIN_M) == dict(kernel="bf16")
    assert f4.default_config(f4.BF16_MIN_M - 1) == dict(kernel="loop")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M, N in [(64, 2304), (256, 2304), (512, 2304)]:
        want = fg.default_config(M, N, 5120, sms)
        a, a_s, b, b_s = _fp8_operands(M, N, 5120, seed=6)
        c = K.fp8_gemm(a, a_s, b, b_s, impl="tilelang")
        assert torch.equal(c, fg.fp8_gemm(a, a_s, b, b_s, **want)), (M, want)
        _check_close(c, K.fp8_gemm(a, a_s, b, b_s, impl="torch"), f"fp8 default M={M} {want}")
    for M, want in [(f4.BF16_MIN_M - 1, "loop"), (f4.BF16_MIN_M, "bf16")]:
        a, a_s, b, b_s = _fp4_gemm_operands(M, 2304, 5120, seed=6)
        c = K.fp4_gemm(a, a_s, b, b_s, impl="tilelang")
        assert torch.equal(c, f4.fp4_gemm(a, a_s, b, b_s, kernel=want)), (M, want)
        _check_close(c, K.fp4_gemm(a, a_s, b, b_s, impl="torch"), f"fp4 default M={M}")


def test_gemm_kernel_option_errors():
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    a, a_s, b, b_s = _fp4_gemm_operands(8, 256, 512)
    with pytest.raises(ValueError, match="kernel must be 'loop' or 'bf16'"):
        f4.fp4_gemm(a, a_s, b, b_s, kernel="pingpong")
    with pytest.raises(ValueError, match="bf16 path takes no kernel options"):
        f4.fp4_gemm(a, a_s, b, b_s, kernel="bf16", BN=128)


# ----------------------------------------------------------------------------- grouped fp4 GEMM (routed experts)
@pytest.mark.parametrize("n,k,counts", [(2304, 5120, [70, 0, 1, 64, 130, 0, 33]),
                                        (5120, 2304, [5, 128, 0, 64, 65]),
                                        (320, 256, [0, 3, 200, 0])],        # N = 2.5 column tiles of 128
                         ids=["w13", "w2", "ragged_n"])
def test_fp4_gemm_grouped(n, k, counts):
    """One launch over all groups: bitwise the plain kernel with the same tile (GROUPED_BM x GROUPED_BN) group by group (no
    row of one group stored by another's tile, no column past N), and close to the torch reference."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    g = torch.Generator(device=DEV).manual_seed(7)
    S = sum(counts)
    x = torch.randn(S, k, device=DEV, generator=g)
    a, a_s = Q.act_quant(x.bfloat16(), 32, "ue8m0", Q.E8M0)
    ws = [Q.quant_fp4(torch.randn(n, k, device=DEV, generator=g) * 0.02) for _ in counts]
    b, b_s = [w for w, _ in ws], [s for _, s in ws]
    c = K.fp4_gemm_grouped(a, a_s, b, b_s, counts, impl="tilelang")
    assert c.shape == (S, n) and c.dtype == torch.bfloat16
    start = 0
    for e, n in enumerate(counts):
        if n:
            want = f4.fp4_gemm(a[start:start + n], a_s[start:start + n], b[e], b_s[e], BM=f4.GROUPED_BM,
                               BN=f4.GROUPED_BN, threads=2 * f4.GROUPED_BM)
            assert torch.equal(c[start:start + n], want), f"group {e}: rows {start}..{start + n}"
        start += n
    _check_close(c, K.fp4_gemm_grouped(a, a_s, b, b_s, counts, impl="torch"), f"fp4 grouped {n}x{k} {counts}")
    assert torch.equal(K.fp4_gemm_grouped(a, a_s, torch.stack(b), torch.stack(b_s), counts, impl="tilelang"), c)


def test_fp4_gemm_grouped_large_groups_take_the_bf16_path():
    """Groups of BF16_MIN_M rows on average run group by group through fp4_gemm (its bf16 path there)."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    counts = [f4.BF16_MIN_M + 3, 0, f4.BF16_MIN_M - 1]
    a, a_s, _, _ = _fp4_gemm_operands(sum(counts), 256, 512, seed=8)
    ws = [_fp4_gemm_operands(1, 256, 512, seed=9 + i)[2:] for i in range(3)]
    b, b_s = [w for w, _ in ws], [s for _, s in ws]
    c = K.fp4_gemm_grouped(a, a_s, b, b_s, counts, impl="tilelang")
    n0 = counts[0]
    assert torch.equal(c[:n0], f4.fp4_gemm(a[:n0], a_s[:n0], b[0], b_s[0]))
    assert torch.equal(c[n0:], f4.fp4_gemm(a[n0:], a_s[n0:], b[2], b_s[2]))
    _check_close(c, K.fp4_gemm_grouped(a, a_s, b, b_s, counts, impl="torch"), "fp4 grouped, large groups")


def test_fp4_gemm_grouped_edges():
    _need_tilelang()
    a, a_s, b, b_s = _fp4_gemm_operands(4, 256, 512)
    assert K.fp4_gemm_grouped(a[:0], a_s[:0], [b, b], [b_s, b_s], [0, 0], impl="tilelang").shape == (0, 256)
    with pytest.raises(ValueError, match="sum to a's 4 rows"):
        K.fp4_gemm_grouped(a, a_s, [b, b], [b_s, b_s], [1, 2], impl="tilelang")
    b2, b2_s = _fp4_gemm_operands(4, 128, 512)[2:]
    with pytest.raises(ValueError, match="the weights differ in shape"):
        K.fp4_gemm_grouped(a, a_s, [b, b2], [b_s, b2_s], [1, 3], impl="tilelang")


# Schedules of the same arithmetic as the default ping-pong: each 32-deep slice summed by the tensor core, then one
# FFMA per element with the exact scale product, slices in order. "halves" issues each slice as two WGMMAs over
# column halves; handoff="issue" only changes when the peer may issue. Their outputs must equal the ping-pong's
# bit for bit, at the release shapes and at ragged ones (partial row and column blocks, masked by TMA).
FP8_SAME_AS_PINGPONG = [dict(kernel="pingpong", handoff="issue"), dict(kernel="halves"),
                        dict(kernel="halves", stages=2), dict(kernel="halves", stages=4, BN=128),
                        dict(kernel="halves", stage_scales=False), dict(kernel="halves", stages=2, stage_scales=False),
                        dict(kernel="halves", stages=4, BN=128, stage_scales=False), dict(),
                        dict(kernel="halves", consumers=3, BN=128), dict(kernel="halves", consumers=3, BN=128,
                                                                         stage_scales=False),
                        dict(kernel="halves", chain=2), dict(kernel="halves", chain=2, stages=2),
                        dict(kernel="halves", chain=2, stage_scales=False),
                        dict(kernel="halves", one_tmp=True, BN=256), dict(kernel="halves", one_tmp=True, BN=256,
                                                                          stages=2, stage_scales=False)]


@pytest.mark.parametrize("cfg", FP8_SAME_AS_PINGPONG, ids=_cfg_id)
@pytest.mark.parametrize("shape", [(300, 5120, 2304), (1000, 2304, 5120), (4096, 5120, 5120), (4096, 5120, 2304)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_schedules_bitwise_equal_pingpong(shape, cfg):
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    a, a_s, b, b_s = _fp8_operands(*shape, seed=4)
    c = fg.fp8_gemm(a, a_s, b, b_s, **cfg)
    want = fg.fp8_gemm(a, a_s, b, b_s, kernel="pingpong")
    assert torch.equal(c, want), f"{cfg} differs from the ping-pong at {int((c != want).sum())} of {c.numel()}"
    _check_close(c, K.fp8_gemm(a, a_s, b, b_s, impl="torch"), f"fp8 {shape} {cfg}")


def test_fp8_gemm_schedule_options_refused():
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    from functional_dsv41.kernels.tilelang import fp8_gemm_ws_tl as fw
    with pytest.raises(ValueError, match="handoff must be"):
        fg.fp8_gemm_pingpong_kernel(5120, 5120, handoff="early")
    with pytest.raises(ValueError, match="BN=160 of 64"):
        fw.fp8_gemm_halves_kernel(5120, 5120, BN=160)
    with pytest.raises(ValueError, match="register pool"):
        fw.fp8_gemm_halves_kernel(5120, 5120, nreg=(248, 24))
    with pytest.raises(ValueError, match="register pool"):
        fw.fp8_gemm_halves_kernel(5120, 5120, consumers=3, BN=128, nreg=(168, 24))
    with pytest.raises(ValueError, match="chain=2 must be 1 or 2, at most stages=3 and divide the K/BK = 5 stages"):
        fw.fp8_gemm_halves_kernel(5120, 640, chain=2)
    with pytest.raises(ValueError, match="consumers=4 must be 2 or 3"):
        fw.fp8_gemm_halves_kernel(5120, 5120, consumers=4)
    a, a_s, b, b_s = _fp8_operands(128, 256, 512)
    with pytest.raises(ValueError, match="kernel must be"):
        fg.fp8_gemm(a, a_s, b, b_s, kernel="halfs")


# ----------------------------------------------------------------------------- group=128: one promotion per 128
# fp8_gemm(..., group=128): operands re-expressed at one scale per 128 columns (quant.align_fp8_groups), and the
# halves kernel chaining four k = 32 WGMMAs in the tensor core before one promotion (a quarter of the FFMAs).
# Against SPEC §10.3 on the same operands only the order of a group's sums differs, but the tensor core adds a
# group's products in fixed point aligned to the largest (the fp8 WGMMA accumulator keeps ~14 bits; DeepSeek-V3
# §3.3.2), so a product far below its group's largest loses bits: each element within 2^-8 of |C| (the bf16
# output) plus 2^-7 of (|A| |B|^T) at that element (run 165, these operands with block scales 2^8 apart: worst
# 2.7e-3 = 2^-8.5 at K = 2304, below 2^-10 at K = 5120; e4m3's own rounding of the operands is 2^-4 of each).
# A dropped or mis-scaled slice shows in the cosine diff (< 1e-5 here, ~1e-2 for one slice of 72 dropped).
FP8_GROUP128 = [{}, dict(kernel="halves"), dict(kernel="halves", stages=2), dict(kernel="halves", stages=4, BN=128),
                dict(kernel="halves", chain=2), dict(kernel="halves", stage_scales=False),
                dict(kernel="halves", consumers=3, BN=128), dict(kernel="halves", one_tmp=True, BN=256),
                dict(kernel="halves", one_tmp=True)]


def _abs8(q):
    return q.float().abs().to(Q.FP8)                # exact: e4m3 is sign-magnitude


def _group128_run(shape, seed, cfg):
    """The release's operands for ``shape``, the same aligned (quant.align_fp8_groups), and on them: the TileLang
    product with group=128 under ``cfg``, SPEC §10.3's (torch, fp32) and |A| |B|^T (fp32), the bound's scale."""
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    a, a_s, b, b_s = _fp8_operands(*shape, seed=seed)
    a2, a2_s = Q.align_fp8_groups(a, a_s, 128)
    b2, b2_s = Q.align_fp8_groups(b, b_s, 128)
    c = fg.fp8_gemm(a2, a2_s, b2, b2_s, group=128, **cfg)
    ref = K.fp8_gemm(a2, a2_s, b2, b2_s, group=128, impl="torch").float()
    mag = K.fp8_gemm(_abs8(a2), a2_s, _abs8(b2), b2_s, group=128, impl="torch", out_dtype=torch.float32)
    return (a, a_s, b, b_s), (a2, a2_s, b2, b2_s), c, ref, mag


@pytest.mark.parametrize("cfg", FP8_GROUP128, ids=lambda c: _cfg_id(c) or "group_config")
@pytest.mark.parametrize("shape", [(300, 5120, 2304), (1000, 2304, 5120), (4096, 5120, 5120)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_group128(shape, cfg):
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    (a, a_s, b, b_s), (a2, a2_s, b2, b2_s), c, ref, mag = _group128_run(shape, 5, cfg)
    err = (c.float() - ref).abs()
    worst = float((err / (2.0 ** -8 * ref.abs() + mag)).max())
    print(f"group128 {shape} {cfg}: cosine diff {cosine_diff(c, ref):.2e}, max |err| / (2^-8 |C| + |A||B|^T) "
          f"= {worst:.2e}")
    assert bool((err <= 2.0 ** -8 * ref.abs() + 2.0 ** -7 * mag).all()), worst
    nbad, mx = _close_bf16(c, ref, ulps=2)          # run 164: 5e-4 to 1e-3 of the elements beyond one bf16 ulp; a
    assert nbad <= c.numel() * 2e-3, (nbad, mx)     # wrong column or row tile would be >= 1/27 of them
    assert cosine_diff(c, ref) < 1e-5
    exact = fg.fp8_gemm(a2, Q.expand_group_scales(a2_s), b2, Q.expand_group_scales(b2_s), kernel="halves")
    assert not torch.equal(c, exact)                # the tensor core's sums of 128 are not four fp32 promotions
    release = K.fp8_gemm(a, a_s, b, b_s, impl="torch")     # the release's own operands (DESIGN: fp8 < 1e-3)
    assert cosine_diff(c, release) < 1e-5, cosine_diff(c, release)


@pytest.mark.parametrize("cfg", [{}, dict(kernel="halves", one_tmp=True)], ids=lambda c: _cfg_id(c) or "default")
@pytest.mark.parametrize("shape", [(5, 96, 256), (64, 320, 128), (200, 70, 384)], ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_group128_small(shape, cfg):
    """The tiny models' shapes: by default the one-wave 64-row loop on the expanded scales (decode-sized M), and
    the group=128 halves kernel asked for by name: one partial row tile, N below one column tile."""
    _need_tilelang()
    _, _, c, ref, mag = _group128_run(shape, 6, cfg)
    assert c.shape == ref.shape
    assert bool(((c.float() - ref).abs() <= 2.0 ** -8 * ref.abs() + 2.0 ** -7 * mag).all())
    assert cosine_diff(c, ref) < 1e-5


def test_fp8_gemm_group128_refusals():
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    from functional_dsv41.kernels.tilelang import fp8_gemm_ws_tl as fw
    a, a_s, b, b_s = _fp8_operands(256, 512, 1024)
    with pytest.raises(ValueError, match=r"a_s must be \[256, 8\] \(one scale per 128"):
        fg.fp8_gemm(a, a_s, b, b_s, group=128)      # the release's 32-wide scales as they are
    a2, a2_s = Q.align_fp8_groups(a, a_s, 128)
    b2, b2_s = Q.align_fp8_groups(b, b_s, 128)
    with pytest.raises(ValueError, match=r"b_s must be \[16, 8\]"):
        fg.fp8_gemm(a2, a2_s, b2, b_s, group=128)
    with pytest.raises(ValueError, match="runs kernel='halves' only"):
        fg.fp8_gemm(a2, a2_s, b2, b2_s, group=128, kernel="pingpong")
    with pytest.raises(ValueError, match="group=64 must be 32"):
        fw.fp8_gemm_halves_kernel(5120, 5120, group=64)
    with pytest.raises(ValueError, match="one_tmp takes chain=1"):
        fw.fp8_gemm_halves_kernel(5120, 5120, one_tmp=True, chain=2)
