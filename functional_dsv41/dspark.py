"""DSpark draft stages (SPEC §7): a block drafter fed by the main model's hidden states.

    main_x  = RMSNorm_main(W_main main_hidden)                 [b, s, dim]   main_hidden = concat of the
                                                                              stream-mean INPUTS of the target layers
    main_kv = fp8_QDQ(RoPE(RMSNorm_kv(W_kv main_x)))           per stage, at the main positions (theta = rope_theta)
    draft   = [last token, noise, ..., noise]                  [b, B] at positions p+1 .. p+B
    h = Embed(draft) x hc streams; pre = one-hot(stream 0)
    for each stage: h, pre = mHC block whose attention reads [main-KV window ring ; the block's own kv]
                           (every draft query sees every filled ring slot and every block position)
    x = hc_pre(h, pre);  logits = head(RMSNorm_norm(x)) (fp32)
    for i in 0..B-1:  e_i = markov.embed[out_i];  logits_i += markov.head e_i;  out_{i+1} = sample(logits_i)
                      confidence_i = proj([x_i ; e_i])

State: ``DecodeState.dspark[s]`` is stage s's window ring of main KV (``AttnCache.window_kv``
[b, W, head_dim], slot = position % W); ``DecodeState.dspark_pos`` says how far the rings are filled
(positions < dspark_pos; a host int, checked without any device work). ``dspark_prefill`` writes the
main KV of the chunk(s) the main model processed since the rings were last filled (positions
``state.pos - s .. state.pos - 1``, which must start at ``dspark_pos``); ``dspark_draft`` writes the main
KV of the newest position ``p = state.pos - 1`` (idempotent if already written; the rings must hold
everything before it) and drafts positions ``p+1 .. p+B``. The draft block's own kv is never stored:
the rings only ever hold main-model KV.

Numerics follow the reference's dtype flow (bit-exact on the tiny fixtures): bf16 activations,
kv fp8-QDQ'd, the ring listed in SLOT order followed by the block (sparse_attn sums in that order),
fp32 LM head, Markov embedding/head and confidence projection in fp32 (the reference holds them fp32).

Shape legend: b batch, B draft block size, W window, D head_dim, H heads, V vocab, r Markov rank.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import kernels, sharding, transforms
from .attention import output_projection, project_qkv
from .config import Config
from .hyper import hc_pre
from .linear import fp8_qdq, linear, qat_format
from .model import make_chunk, mhc_block
from .validate import _check_ids, _check_inputs, _not_int_tensor, _outside_vocab
from .norm import rms_norm
from .rope import apply_rope, rope_angles
from .state import AttnCache, DecodeState, config_mismatch


def main_x(params: dict, main_hidden: torch.Tensor, *, cfg: Config, mode: str = "reference",
           impl: str | None = None) -> torch.Tensor:
    """main_hidden [b, s, n_targets*dim] bf16 -> RMSNorm(main_norm, W_main main_hidden) [b, s, dim] bf16."""
    p0 = params["mtp"][0]
    return rms_norm(linear(main_hidden, p0["main_proj"], mode=mode, fake=qat_format(cfg), impl=impl), p0["main_norm"]["weight"], cfg.norm_eps)


def main_kv(p_attn: dict, mx: torch.Tensor, positions: torch.Tensor, *, cfg: Config, layer_id: int,
            mode: str = "reference", qdq: bool = True, impl: str | None = None) -> torch.Tensor:
    """A stage's KV of main positions: fp8_QDQ(RoPE(RMSNorm_kv(W_kv main_x))). mx [b, s, dim],
    positions int64 [s] or [b, s] -> [b, s, D] bf16 (SPEC §7 "Prefill")."""
    kv = rms_norm(linear(mx, p_attn["wkv"], mode=mode, fake=qat_format(cfg), impl=impl), p_attn["kv_norm"]["weight"], cfg.norm_eps)
    return fp8_qdq(apply_rope(kv, rope_angles(cfg, layer_id, positions)), qdq)


def _write_ring(ring: torch.Tensor, rows: torch.Tensor, start: int) -> torch.Tensor:
    """ring [b, W, D] with rows [b, s, D] for positions start..start+s-1 written at slot pos % W (new tensor)."""
    W, s = ring.shape[1], rows.shape[1]
    keep = min(s, W)                                   # only the newest W positions survive
    pos = torch.arange(start + s - keep, start + s, device=ring.device)
    return ring.index_copy(1, pos % W, rows[:, s - keep:].to(ring.dtype))


def _check_state(params: dict, state: DecodeState, cfg: Config, b: int, where: str) -> None:
    if not isinstance(state, DecodeState):
        raise TypeError(f"{where}: state must be a DecodeState (fd.init_state), got {type(state).__name__}")
    why = config_mismatch(state.config_id, cfg)
    if why:
        raise ValueError(f"{where}: {why}")
    if state.batch_size != b:
        raise ValueError(f"{where}: the state holds {state.batch_size} rows, the input has {b}")
    if len(state.dspark) != cfg.n_mtp_layers:
        raise ValueError(f"{where}: the config has no DSpark stages (n_mtp_layers = {cfg.n_mtp_layers})")
    _check_stages(params, cfg, where)


def _check_stages(params: dict, cfg: Config, where: str) -> None:
    """The config has DSpark stages and params hold one 'mtp' entry per stage (host-only); a tree without
    'mtp' failed with a bare KeyError."""
    if cfg.n_mtp_layers < 1:
        raise ValueError(f"{where}: the config has no DSpark stages (n_mtp_layers = {cfg.n_mtp_layers})")
    if not isinstance(params, dict):
        raise TypeError(f"{where}: params must be the parameter tree (a dict, fd.init_params / fd.load_params), "
                        f"got {type(params).__name__}")
    if len(params.get("mtp", ())) != cfg.n_mtp_layers:
        raise ValueError(f"{where}: params have {len(params.get('mtp', ()))} DSpark stages ('mtp'), "
                         f"the config {cfg.n_mtp_layers}")


def _check_sampling(temperature, top_p, where: str) -> None:
    """generate's rule for temperature / top_p (host-only): a negative temperature ran greedy silently, a NaN one
    or top_p <= 0 failed inside torch.multinomial, top_p > 1 was taken."""
    from .generate import sampling_ok                   # (generate imports this module)
    if not sampling_ok(temperature, top_p):
        raise ValueError(f"{where}: need temperature >= 0 (0 = greedy) and 0 < top_p <= 1, got "
                         f"temperature={temperature!r}, top_p={top_p!r}")


def _check_hidden(main_hidden: torch.Tensor, cfg: Config, where: str) -> None:
    want = len(cfg.dspark_target_layer_ids) * cfg.dim
    if main_hidden.dim() != 3 or main_hidden.shape[-1] != want:
        raise ValueError(f"{where}: main_hidden must be [b, s, {want}] (forward(...).main_hidden), "
                         f"got {tuple(main_hidden.shape)}")


def dspark_prefill(params: dict, main_hidden: torch.Tensor, *, cfg: Config, state: DecodeState,
                   mode: str = "reference", impl: str | None = None) -> DecodeState:
    """Seed/extend every stage's main-KV ring with the chunk the main model just ran (SPEC §7 "Prefill").

    main_hidden [b, s, n_targets*dim] = ``forward(...).main_hidden`` of that chunk; ``state`` = the
    state that forward returned (the chunk covers positions ``state.pos - s .. state.pos - 1``).
    The chunk must start where the rings stop (``state.dspark_pos``): call it after every forward
    (several forwards' main_hidden may be concatenated), and after ``speculative.rollback`` with the
    accepted positions' main_hidden. Returns the state with new ``dspark`` rings and
    ``dspark_pos = state.pos`` (everything else shared).
    """
    transforms.check_unsharded(params)
    _check_hidden(main_hidden, cfg, "dspark_prefill")
    _check_state(params, state, cfg, main_hidden.shape[0], "dspark_prefill")
    s = main_hidden.shape[1]
    start = state.pos - s
    if start < 0:
        raise ValueError(f"dspark_prefill: {s} hidden rows but the state is at position {state.pos}")
    if start != state.dspark_pos:
        if start > state.dspark_pos:
            hint = (f"positions {state.dspark_pos}..{start - 1} were never written to them: pass the main_hidden "
                    f"of every forward since (concatenated), or call dspark_prefill after each forward")
        else:
            hint = (f"positions {start}..{state.dspark_pos - 1} are already written: pass only the main_hidden "
                    f"of the forward(s) since the last dspark_prefill")
        raise ValueError(f"dspark_prefill: the DSpark rings {_filled(state.dspark_pos)}, but these {s} main_hidden "
                         f"rows would cover positions {start}..{state.pos - 1} (the state is at {state.pos}) and "
                         f"must start where the rings stop; {hint}")
    return _fill_rings(params, main_hidden, start, cfg=cfg, state=state, mode=mode, impl=impl)


def _filled(n: int) -> str:
    return "hold no main KV yet" if n == 0 else f"hold the main KV up to position {n - 1}"


def _fill_rings(params: dict, main_hidden: torch.Tensor, start: int, *, cfg: Config, state: DecodeState,
                mode: str, impl) -> DecodeState:
    """Write the main KV of positions start .. start+s-1 into every stage ring; dspark_pos -> start + s."""
    s = main_hidden.shape[1]
    mx = main_x(params, main_hidden, cfg=cfg, mode=mode, impl=impl)
    pos = torch.arange(start, start + s, device=mx.device)
    rings = []
    for si, L in enumerate(cfg.dspark_layer_ids):
        kv = main_kv(params["mtp"][si]["attn"], mx, pos, cfg=cfg, layer_id=L, mode=mode, impl=impl)
        rings.append(AttnCache(_write_ring(state.dspark[si].window_kv, kv, start)))
    return dataclasses.replace(state, dspark=tuple(rings), dspark_pos=start + s)


def _stage_attention(p: dict, x: torch.Tensor, kv_all: torch.Tensor, idx: torch.Tensor, rot: torch.Tensor, *,
                     cfg: Config, mode: str, impl, qdq: bool, debug: Optional[dict]):
    """Draft attention (SPEC §7): x [b, M, dim] normed draft inputs; kv_all [b, N, D] the stage's main-KV
    rows, to which the M draft rows' own kv (fp8 QDQ) are appended; idx [b, M, T] indexes
    [main rows ; draft rows] (-1 = none); rot [b, M, rd/2] the queries' rotations -> [b, M, dim]."""
    _, q, kv = project_qkv(p, x, rot, cfg=cfg, mode=mode, impl=impl, qdq=qdq)
    kv_all = torch.cat([kv_all, kv], 1)
    o = kernels.sparse_attn(q, kv_all, p["attn_sink"], idx.to(torch.int32), cfg.head_dim ** -0.5, impl=impl)
    if debug is not None:
        debug.update(sparse_idx=idx, sparse_kv=kv_all, sparse_out=o)
    return output_projection(p, o, rot, cfg=cfg, mode=mode, impl=impl)


def _stages(params: dict, ids: torch.Tensor, main_rows: list, idx: torch.Tensor, qpos: torch.Tensor, *,
            cfg: Config, mode: str, impl, dispatch: str, qdq: bool = True, debug: Optional[dict] = None):
    """Run all draft stages. ids [b, M] draft tokens; main_rows[s] [b, N, D] stage s's main KV rows;
    idx [b, M, T] into [main rows ; the M block rows]; qpos [b, M] positions -> x = hc_pre(h, pre) [b, M, dim].
    Each stage is a backbone block (``model.mhc_block``: mHC, RMSNorms, MoE; no image mask) whose attention is
    ``_stage_attention`` over its main-KV rows and the block's own kv, the queries rotated at ``qpos``."""
    b, M = ids.shape
    h = sharding.embedding(ids, params["embed"]["weight"])          # (= F.embedding; rows may be split)
    h = h.unsqueeze(2).expand(b, M, cfg.hc_mult, cfg.dim).contiguous()
    pre = torch.zeros(b, M, cfg.hc_mult, dtype=torch.float32, device=ids.device)
    pre[..., 0] = 1.0
    for si, L in enumerate(cfg.dspark_layer_ids):
        p, rot = params["mtp"][si], rope_angles(cfg, L, qpos)

        def attend(x, d):                   # (mhc_block calls it at once: p, si, rot are this stage's)
            return _stage_attention(p["attn"], x, main_rows[si], idx, rot, cfg=cfg, mode=mode, impl=impl, qdq=qdq,
                                    debug=d)

        h, pre = mhc_block(p, h, pre, attend, cfg=cfg, layer_id=L, mode=mode, impl=impl, dispatch=dispatch,
                           debug=debug, debug_prefix=f"stage.{si}.")
    return hc_pre(h, pre, impl=impl)


def _head(params: dict, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """x [..., dim] bf16 -> base draft logits [..., V] fp32 (shared LM head, last stage's norm)."""
    pl = params["mtp"][-1]
    return sharding.vocab_logits(rms_norm(x, pl["norm"]["weight"], cfg.norm_eps).float(), params["head"]["weight"])


def _markov(params: dict, tok: torch.Tensor):
    """tok int64 [...] -> (e [..., r] fp32, bias [..., V] fp32): the Markov head (fp32 as the reference holds it)."""
    pl = params["mtp"][-1]
    e = F.embedding(tok, pl["markov_head"]["embed"]["weight"]).float()
    return e, F.linear(e, pl["markov_head"]["head"]["weight"].float())


def _confidence(params: dict, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """proj([x ; e]) in fp32: x [..., dim] bf16, e [..., r] fp32 -> [...] fp32."""
    w = params["mtp"][-1]["confidence_head"]["proj"]["weight"].float()
    return F.linear(torch.cat([x.float(), e], -1), w).squeeze(-1)


def sample_logits(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits [..., V] fp32 -> token ids [...] int64. temperature 0: argmax; else a draw from
    ``probs(logits, temperature, top_p)`` with ``generator`` (``torch.multinomial``)."""
    if temperature <= 0:
        return logits.argmax(-1)
    pr = probs(logits, temperature, top_p)
    return torch.multinomial(pr.reshape(-1, pr.shape[-1]), 1, generator=generator).reshape(pr.shape[:-1])


def probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution [..., V] fp32: softmax(logits / T), restricted to the smallest set of
    tokens whose probability reaches ``top_p`` (nucleus; ties at the edge kept in sorted order), renormalised.
    The logits are shifted by their maximum before the division, so that a tiny T (below ~1e-38 logits / T
    overflows fp32, and softmax(inf) is NaN) gives the argmax's one-hot, not a NaN distribution; the most likely
    token is always kept (a top_p below fp32's smallest subnormal rounds to 0 and used to drop every token)."""
    x = logits.float()
    pr = torch.softmax((x - x.amax(-1, keepdim=True)) / temperature, -1)
    if top_p < 1.0:
        sp, si = pr.sort(-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= top_p                # mass before this token already reaches top_p
        drop[..., 0] = False
        sp = sp.masked_fill(drop, 0.0)
        pr = torch.zeros_like(pr).scatter(-1, si, sp)
        pr = pr / pr.sum(-1, keepdim=True)
    return pr


@dataclass(frozen=True)
class Draft:
    """dspark_draft's result. out_ids [b, B+1] int64 = [given token, B drafted tokens]; logits [b, B, V]
    fp32 (Markov bias included; logits[:, i] is the distribution of out_ids[:, i+1]); confidence [b, B]
    fp32; state = the state with the DSpark rings holding main KV up to position state.pos - 1."""
    out_ids: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    state: DecodeState

    def __iter__(self):  # (out_ids, logits, confidence, state) = dspark_draft(...)
        return iter((self.out_ids, self.logits, self.confidence, self.state))


def dspark_draft(params: dict, last_token: torch.Tensor, main_hidden_p: torch.Tensor, *, cfg: Config,
                 state: DecodeState, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, mode: str = "reference", impl=None,
                 dispatch: str = "sorted", validate: bool = True, debug: Optional[dict] = None) -> Draft:
    """Draft ``B = cfg.dspark_block_size`` tokens after ``last_token`` (SPEC §7 "Decode", "Head").

    last_token int64 [b] (or [b, 1]): the newest sampled token, to sit at position ``state.pos``;
    main_hidden_p [b, 1, n_targets*dim]: ``forward(...).main_hidden`` of position p = state.pos - 1
    (the last position the main model consumed). The stage rings must hold the main KV of every
    position before p (``state.dspark_pos`` p or p+1: ``dspark_prefill`` after each forward, else a
    ValueError); they get position p's main KV here. The block [last_token, noise, ...] is drafted at
    positions p+1 .. p+B; sampling is sequential (the Markov bias of position i depends on out_ids[i]).
    Returns ``Draft(out_ids, logits, confidence, state)``.
    ``debug`` receives ``stage.{s}.*`` tensors named like the golden ``decode.{k}.spec.*``.
    temperature >= 0 (0 = greedy) and 0 < top_p <= 1, as in ``generate``. ``validate=False`` skips the
    data-dependent check (last_token within the vocabulary: a device sync), as ``forward``'s does.
    """
    transforms.check_unsharded(params)
    _check_sampling(temperature, top_p, "dspark_draft")
    got = _not_int_tensor(last_token)
    if got:
        raise TypeError(f"dspark_draft: last_token must be an integer tensor [b] (or [b, 1]) of token ids, "
                        f"got {got}")
    _check_hidden(main_hidden_p, cfg, "dspark_draft")
    last = last_token.reshape(-1).long()
    b = last.shape[0]
    _check_state(params, state, cfg, b, "dspark_draft")
    if validate and (bad := _outside_vocab(last, cfg)) is not None:
        raise ValueError(f"dspark_draft: last_token holds token id {bad}, outside the vocabulary "
                         f"[0, {cfg.vocab_size})")
    if main_hidden_p.shape[:2] != (b, 1):
        raise ValueError(f"dspark_draft: main_hidden_p must be [{b}, 1, ...] (position state.pos - 1), "
                         f"got {tuple(main_hidden_p.shape)}")
    p = state.pos - 1
    if p < 0:
        raise ValueError("dspark_draft: the main model has consumed no token yet (state.pos == 0)")
    if state.dspark_pos not in (p, p + 1):
        if state.dspark_pos < p:
            why = (f"they lack positions {state.dspark_pos}..{p - 1}: call dspark_prefill(params, out.main_hidden, "
                   f"state=out.state) after every forward (and after speculative.rollback, with the accepted "
                   f"positions' main_hidden)")
        else:
            why = "they hold positions the state has not reached (rings from a later state?)"
        raise ValueError(f"dspark_draft: the DSpark rings {_filled(state.dspark_pos)}, but the state is at "
                         f"position {state.pos} (the draft needs the main KV of every position before {p} in "
                         f"them); {why}")
    B, W, dev = cfg.dspark_block_size, cfg.window_size, last.device
    state = _fill_rings(params, main_hidden_p, p, cfg=cfg, state=state, mode=mode, impl=impl)
    rings = [c.window_kv for c in state.dspark]
    ids = torch.full((b, B), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
    ids[:, 0] = last
    qpos = torch.arange(p + 1, p + 1 + B, device=dev).expand(b, B)
    slot = torch.arange(W, device=dev)
    idx = torch.cat([torch.where(slot <= p, slot, -1), W + torch.arange(B, device=dev)])   # ring slots, then block
    idx = idx.expand(b, B, W + B)
    x = _stages(params, ids, rings, idx, qpos, cfg=cfg, mode=mode, impl=impl, dispatch=dispatch, debug=debug)
    logits = _head(params, x, cfg)
    out, es, lg = [last], [], []
    for i in range(B):
        e, bias = _markov(params, out[i])
        es.append(e)
        lg.append(logits[:, i] + bias)
        out.append(sample_logits(lg[i], temperature, top_p, generator))
    conf = _confidence(params, x, torch.stack(es, 1))       # one GEMM over the block, as the reference
    return Draft(torch.stack(out, 1), torch.stack(lg, 1), conf, state)


@dataclass(frozen=True)
class DSparkOutput:
    """dspark_forward's result, per anchor a (main position p = anchors[a]) and draft slot i < B:
    logits [b, n, B, V] fp32 (teacher-forced Markov bias), confidence [b, n, B] fp32,
    targets [b, n, B] int64 = the token at position p+2+i, -1 where it lies past the row or in another
    packed sample (no loss there)."""
    logits: torch.Tensor
    confidence: torch.Tensor
    targets: torch.Tensor


def dspark_forward(params: dict, main_hidden: torch.Tensor, input_ids: torch.Tensor, *, cfg: Config,
                   positions: Optional[torch.Tensor] = None, anchors: Optional[torch.Tensor] = None,
                   mode: str = "reference", impl=None, dispatch: str = "sorted", qdq: bool = True,
                   validate: bool = True, debug: Optional[dict] = None) -> DSparkOutput:
    """Stateless, teacher-forced draft over a whole (plain or packed) sequence: the draft loss's forward.

    main_hidden [b, S, n_targets*dim] = ``forward(params, batch).main_hidden`` of the same rows;
    input_ids int64 [b, S]; positions [b, S] per-sample positions of packed rows (None: one sample
    per row); anchors int64 [n] main positions p to draft after (default: every p in 0..S-2).
    For anchor p the block is ``[input_ids[p+1], noise, ..]`` at positions p+1..p+B and sees the main
    KV of positions max(sample start, p-W+1)..p plus the whole block - exactly what ``dspark_draft``
    computes in decode after the main model consumed position p, rows listed in the same ring-slot
    order (so the two agree bit for bit). The Markov bias of slot i is teacher-forced: it comes from the
    TRUE token at p+1+i (decode uses the sampled one). Targets: the token at p+2+i.
    Returns ``DSparkOutput(logits [b, n, B, V], confidence [b, n, B], targets [b, n, B])``.
    ``mode``/``dispatch``/``qdq`` as in ``forward`` (qdq=False: no fp8 KV QDQ, the smooth model).
    Cost: n*B draft queries; pass a subset of anchors for long rows (logits are n*B*V fp32).
    Inputs are checked as ``forward`` checks them (its own checks: input_ids' type and rank, ``positions``);
    ``validate=False`` skips the data-dependent ones (ids within the vocabulary, params against the config),
    as ``forward``'s does.
    """
    where = "dspark_forward"
    transforms.check_unsharded(params)
    _check_hidden(main_hidden, cfg, where)
    batch = {"input_ids": input_ids}
    _check_ids(batch, where)
    if input_ids.shape != main_hidden.shape[:2]:
        raise ValueError(f"dspark_forward: input_ids {tuple(input_ids.shape)} must be [b, S] matching "
                         f"main_hidden {tuple(main_hidden.shape[:2])}")
    if validate:
        _check_inputs(params, batch, cfg, None, where)
    _check_stages(params, cfg, where)
    got = None if anchors is None else _not_int_tensor(anchors)
    if got:
        raise TypeError(f"dspark_forward: anchors must be an integer tensor [n] of main positions, got {got}")
    b, S = input_ids.shape
    B, W, dev = cfg.dspark_block_size, cfg.window_size, input_ids.device
    ids = input_ids.long()
    if positions is not None:
        batch["positions"] = positions
    pos = make_chunk(batch, 0, dev, where).pos           # [b, S]; packed positions checked as forward does
    if anchors is None:
        anchors = torch.arange(max(S - 1, 0), device=dev)
    anchors = anchors.to(dev, torch.long).reshape(-1)
    n = anchors.shape[0]
    if n == 0 or int(anchors.min()) < 0 or int(anchors.max()) > S - 2:
        raise ValueError(f"dspark_forward: anchors must be a non-empty subset of 0..{S - 2}")
    seg = torch.arange(S, device=dev) - pos                                   # [b, S] sample start (absolute)
    bi = torch.arange(b, device=dev)[:, None]
    p_abs = anchors.expand(b, n)
    p_rel = pos[bi, p_abs]                                                    # [b, n]
    # block tokens / positions / teacher tokens / targets
    off = torch.arange(B + 1, device=dev)
    t_abs = p_abs[..., None] + 1 + off                                        # [b, n, B+1] positions p+1 .. p+B+1
    inside = t_abs < S
    t_c = t_abs.clamp(max=S - 1)
    same = inside & (seg[bi[..., None], t_c] == seg[bi, p_abs][..., None])
    tok = torch.where(same, ids[bi[..., None], t_c], cfg.dspark_noise_token_id)   # true tokens (noise past the end)
    blk = torch.full((b, n, B), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
    blk[..., 0] = tok[..., 0]
    targets = torch.where(same[..., 1:] & same[..., :1], tok[..., 1:], -1)    # no target if p+1 is another sample
    qpos = (p_rel[..., None] + 1 + off[:B]).reshape(b, n * B)
    # window rows in ring-slot order: slot j holds the newest t <= p with t % W == j (sample-relative)
    j = torch.arange(W, device=dev)
    t_rel = p_rel[..., None] - ((p_rel[..., None] - j) % W)                   # [b, n, W]
    win = torch.where(t_rel >= 0, p_abs[..., None] - p_rel[..., None] + t_rel, -1)
    own = S + torch.arange(n, device=dev)[:, None] * B + torch.arange(B, device=dev)   # [n, B] rows of a's block
    idx = torch.cat([win[:, :, None, :].expand(b, n, B, W), own[:, None, :].expand(b, n, B, B)], -1).reshape(b, n * B, W + B)
    mx = main_x(params, main_hidden, cfg=cfg, mode=mode, impl=impl)
    rows = [main_kv(params["mtp"][si]["attn"], mx, pos, cfg=cfg, layer_id=L, mode=mode, qdq=qdq, impl=impl)
            for si, L in enumerate(cfg.dspark_layer_ids)]
    x = _stages(params, blk.reshape(b, n * B), rows, idx, qpos, cfg=cfg, mode=mode, impl=impl,
                dispatch=dispatch, qdq=qdq, debug=debug).view(b, n, B, cfg.dim)
    e, bias = _markov(params, tok[..., :B])
    logits = _head(params, x, cfg) + bias
    return DSparkOutput(logits, _confidence(params, x, e), targets)
