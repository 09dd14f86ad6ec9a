"""Lightning indexer selection (SPEC §5) in TileLang for Hopper: exact top-k and the level-1 candidate blocks.

Top-k, per row: 16-bit order-preserving keys of the bf16 scores (-0 ties with +0, -inf never
selected), a two-pass 8-bit radix select for the threshold key K* and the number r of entries equal
to K* still needed, then an ordered compaction (per-thread contiguous segments + a block scan):
entries > K* and the first r entries == K* in index order. Output is therefore ascending, exactly the
reference's set (ties to the lower index), -1 padding after min(k, #finite) entries. One CTA per row;
its thread count follows the row count and length (``_topk_threads``, from run 9's sweep).

Candidate blocks (level 1), plain and packed rows: block maxima (torch amax / scatter amax, exact),
the newest visible block forced to +inf, and the same top-k kernel over the block scores
(``index_candidates``).
"""

import functools

import torch
import tilelang.language as T

from ._common import compile_kernel, plain, sm_count

BF16, I32 = "bfloat16", "int32"


# ----------------------------------------------------------------------------- top-k
@functools.lru_cache(maxsize=None)
def topk_kernel(KT: int, threads: int = 512, agg: bool = False):
    """Idx [R, KT] int32 = exact top-KT of each row of X [R, N] bf16 (ascending, -1 padding).

    ``agg``: warp-aggregated histogram updates (__match_any_sync over the bin, one shared atomic of the
    group's popcount by its lowest lane). Index scores cluster in a few exponents, so the high-byte
    pass sends most of a warp's 32 increments to the same 1-3 bins, which the plain atomics serialize."""
    R, N = T.dynamic("R"), T.dynamic("N")
    NT = threads

    @T.macro
    def hist_add(hist, bin_, ok):
        # add 1 to hist[bin_] where ok; with agg, lanes with equal bins (invalid ones get bin 256) merge
        if agg:
            b = T.if_then_else(ok, bin_, 256)
            grp = T.call_extern("uint32", "__match_any_sync", T.call_extern("uint32", "__activemask"), b)
            lead = T.call_extern("int32", "__ffs", grp) - 1
            if ok and lead == (T.get_thread_binding() & 31):
                T.atomic_add(hist[bin_], T.call_extern("int32", "__popc", grp))
        else:
            if ok:
                T.atomic_add(hist[bin_], 1)

    @T.macro
    def key_of(x):
        # order-preserving 16-bit key of a bf16 (as int32 0..65535); -0 maps onto +0
        u = T.Cast(I32, T.reinterpret("uint16", x))
        u0 = T.if_then_else(u == 0x8000, 0, u)
        return T.if_then_else(u0 >= 0x8000, 0xFFFF - u0, u0 + 0x8000)

    @T.prim_func
    def index_topk(X: T.Tensor([R, N], BF16), Idx: T.Tensor([R, KT], I32)):
        with T.Kernel(R, threads=NT) as row:
            tx = T.get_thread_binding()
            hist = T.alloc_shared([257], I32)
            scan = T.alloc_shared([2 * NT], I32)
            info = T.alloc_shared([4], I32)        # nvalid, threshold key, ties to take, -
            kk = T.alloc_var(I32)
            rem = T.alloc_var(I32)
            b1 = T.alloc_var(I32)
            thr = T.alloc_var(I32)
            ntie = T.alloc_var(I32)
            cgt = T.alloc_var(I32)
            ctie = T.alloc_var(I32)
            pos = T.alloc_var(I32)
            v = T.alloc_var(I32)
            key = T.alloc_var(I32)
            seg = T.ceildiv(N, NT)

            # pass 1: histogram of the high byte of the keys of finite entries (-inf key = 0x007F)
            for i in T.serial(T.ceildiv(257, NT)):
                if i * NT + tx < 257:
                    hist[i * NT + tx] = 0
            if tx == 0:
                info[0] = 0
                info[1] = 0
                info[2] = 0
            T.sync_threads()
            for it in T.serial(T.ceildiv(N, NT)):
                j = it * NT + tx
                if j < N:
                    key = key_of(X[row, j])
                    hist_add(hist, key >> 8, key != 0x007F)
            T.sync_threads()
            # suffix sums over the 256 bins (hist[256] = 0): hist[b] = #(high byte >= b)
            for step in T.serial(8):
                if tx < 256:
                    v = hist[tx] + T.if_then_else(tx + (1 << step) < 256, hist[tx + (1 << step)], 0)
                T.sync_threads()
                if tx < 256:
                    hist[tx] = v
                T.sync_threads()
            kk = T.min(KT, hist[0])
            if tx < 256:
                if kk > 0 and hist[tx] >= kk and hist[tx + 1] < kk:
                    info[1] = tx
            T.sync_threads()
            b1 = info[1]
            rem = kk - hist[b1 + 1]
            T.sync_threads()
            # pass 2: low byte among entries whose high byte is b1
            for i in T.serial(T.ceildiv(257, NT)):
                if i * NT + tx < 257:
                    hist[i * NT + tx] = 0
            T.sync_threads()
            if kk > 0:
                for it in T.serial(T.ceildiv(N, NT)):
                    j = it * NT + tx
                    if j < N:
                        key = key_of(X[row, j])
                        hist_add(hist, key & 0xFF, key != 0x007F and (key >> 8) == b1)
            T.sync_threads()
            for step in T.serial(8):
                if tx < 256:
                    v = hist[tx] + T.if_then_else(tx + (1 << step) < 256, hist[tx + (1 << step)], 0)
                T.sync_threads()
                if tx < 256:
                    hist[tx] = v
                T.sync_threads()
            if tx < 256:
                if kk > 0 and hist[tx] >= rem and hist[tx + 1] < rem:
                    info[2] = tx
            T.sync_threads()
            thr = b1 * 256 + info[2]
            ntie = rem - hist[info[2] + 1]             # entries equal to the threshold key to take
            # pass 3: ordered compaction over contiguous segments of `seg` entries per thread
            cgt = 0
            ctie = 0
            if kk > 0:
                for e in T.serial(seg):
                    j = tx * seg + e
                    if j < N:
                        key = key_of(X[row, j])
                        if key != 0x007F:
                            if key > thr:
                                cgt += 1
                            if key == thr:
                                ctie += 1
            scan[tx] = cgt
            scan[NT + tx] = ctie
            T.sync_threads()
            # inclusive Hillis-Steele scans of both counts
            off = T.alloc_var(I32)
            a = T.alloc_var(I32)
            c = T.alloc_var(I32)
            off = 1
            while off < NT:
                a = scan[tx] + T.if_then_else(tx >= off, scan[T.max(tx - off, 0)], 0)
                c = scan[NT + tx] + T.if_then_else(tx >= off, scan[NT + T.max(tx - off, 0)], 0)
                T.sync_threads()
                scan[tx] = a
                scan[NT + tx] = c
                T.sync_threads()
                off = off * 2
            cgt = scan[tx] - cgt                      # exclusive: before this thread's segment
            ctie = scan[NT + tx] - ctie
            if kk > 0:
                for e in T.serial(seg):
                    j = tx * seg + e
                    if j < N:
                        key = key_of(X[row, j])
                        if key != 0x007F:
                            if key > thr:
                                Idx[row, cgt + T.min(ctie, ntie)] = j
                                cgt += 1
                            if key == thr:
                                if ctie < ntie:
                                    Idx[row, cgt + ctie] = j
                                ctie += 1
            for i in T.serial(T.ceildiv(KT, NT)):
                p = i * NT + tx
                if p < KT and p >= kk:
                    Idx[row, p] = -1

    return compile_kernel(index_topk, out_idx=[1])


TOPK_THREADS = None     # None: by row length (_topk_threads); an int forces one count
TOPK_AGG = False        # warp-aggregated histogram atomics in the top-k kernel (bench: "agg")


def _topk_threads(rows: int, n: int, sms: int) -> int:
    """Threads per row of the top-k kernel. Run 9 (H200): 4096 rows x 1024 -> 256 best (0.049 ms vs 0.070
    at 512, 0.121 at 1024: several CTAs per SM); 64 x 16384 and 16 x 65536 -> 1024 best (0.027 / 0.114 ms
    vs 0.061 / 0.205 at 256: one CTA per row and SM, so the row's latency is all that counts). So: few
    rows (under 2 waves of SMs) on rows longer than 1024 take 1024 threads; otherwise 256 up to 4096
    entries, 512 beyond (unmeasured middle ground; the bench sweeps it)."""
    if rows < 2 * sms and n > 1024:
        return 1024
    return 256 if n <= 4096 else 512


def index_topk(score, k, threads=None, agg=None):
    """Same contract as ``reference.index_topk`` (int64 ids ascending, -1 padding; exact ties to the
    lower index). One kernel per requested k: rows shorter than k take the first n columns."""
    n = score.shape[-1]
    kk = min(k, n)
    lead = score.shape[:-1]
    if kk == 0:
        return score.new_zeros(lead + (0,), dtype=torch.int64)
    if score.dtype != torch.bfloat16:
        from ..reference_indexer import index_topk as ref
        return ref(score, k)
    # indices carry no gradient: under torch.func.grad launch on the unwrapped storage, with functorch off
    # (every tensor made while it is on, the kernel's output included, would be a storage-less wrapper)
    with torch._C._DisableFuncTorch():
        x = plain(score).reshape(-1, n).contiguous()
        th = threads or TOPK_THREADS or _topk_threads(x.shape[0], n, sm_count(x.device))
        idx = topk_kernel(int(k), th, TOPK_AGG if agg is None else agg)(x)
    return idx[:, :kk].long().reshape(lead + (kk,))


def index_candidates(score, lo, hi, blocks, n_blocks, topk_blocks, threads=None, agg=None):
    """Level-1 candidate blocks: [b, s, nb] block scores (exact maxima of bf16 scores, -inf where a block
    has no visible entry), the newest visible entry's block set to +inf, then the top-k kernel over the
    [b*s, nb] block scores (the reference's exact rule: ties to the lower block id, -inf never kept),
    expanded back to entries. Plain rows (``blocks`` an int block size): block maxima by a torch amax
    over [nb, B] views. Packed rows (a [b, n] block-id tensor): block maxima by a scatter amax (in fp32
    as the reference, then bf16: exact, every value is a bf16), the forced block read from ``blocks``."""
    b, s, n = score.shape
    if score.dtype != torch.bfloat16 or n == 0 or n_blocks == 0:
        from ..reference_indexer import index_candidates as ref
        return ref(score, lo, hi, blocks, n_blocks, topk_blocks)
    nb = n_blocks
    has = hi > lo
    newest = torch.where(has, hi - 1, 0)
    if isinstance(blocks, int):
        B = blocks
        x = score
        if nb * B != n:
            x = torch.nn.functional.pad(x, (0, nb * B - n), value=float("-inf"))
        bs = x.view(b, s, nb, B).amax(-1)                                        # [b, s, nb] bf16
        fb = newest // B
    else:
        idx_e = blocks[:, None, :].expand(b, s, n)
        bs = torch.full((b, s, nb), float("-inf"), device=score.device)
        bs = bs.scatter_reduce(-1, idx_e, score.float(), reduce="amax", include_self=True).to(torch.bfloat16)
        fb = blocks.gather(1, newest)
    forced = torch.nn.functional.one_hot(fb, nb).bool() & has[..., None]
    bs = bs.masked_fill(forced, float("inf"))
    kb = min(topk_blocks, nb)
    with torch._C._DisableFuncTorch():                     # as in index_topk
        bs = plain(bs).reshape(b * s, nb).contiguous()
        th = threads or TOPK_THREADS or _topk_threads(b * s, nb, sm_count(bs.device))
        idx = topk_kernel(int(topk_blocks), th, TOPK_AGG if agg is None else agg)(bs)[:, :kb].long()
    keep = torch.zeros(b * s, nb + 1, dtype=torch.bool, device=score.device)
    keep.scatter_(1, torch.where(idx >= 0, idx, nb), True)
    keep = keep[:, :nb].view(b, s, nb)
    if isinstance(blocks, int):
        return keep.repeat_interleave(blocks, -1)[..., :n]
    return keep.gather(-1, blocks[:, None, :].expand(b, s, n))
