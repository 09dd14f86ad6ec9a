"""Text generation: ``fd.generate`` (plain or DSpark-speculative) and the ``python -m`` CLI (SPEC §13).

Batches of prompts of different lengths share ONE decode position (``DecodeState.pos``), so, as
the reference generate.py does, the batch is right-padded, prefilled up to the SHORTEST prompt, then
advanced one position per step; a row still inside its prompt takes its prompt token instead of the
sample. Every row therefore sees exactly the tokens it would see alone, and (up to the rounding of
batched GEMMs) gets the same tokens when greedy; sampled rows share one generator, so a row's samples
depend on the other rows of its batch (the same batch and seed reproduce them). Speculative decoding (``speculative=True``) advances by the
accepted length of a drafted block instead (functional_dsv41/speculative.py); prompt tokens inside
the block are "drafts" accepted by fiat; the accepted length is the minimum over unfinished rows.

Host synchronisation: one per step for the stop check (and, speculative, the accepted length);
sampling uses a seeded ``torch.Generator`` on the tokens' device. Outputs exclude the prompt and stop
BEFORE ``eos_id`` (as the reference does); ``result.stats`` says why each row stopped.

    .venv/bin/python -m functional_dsv41.generate --ckpt DIR --prompt TEXT [--max-new-tokens N]
        [--temperature T] [--top-p P] [--speculative] [--seed S] [--image FILE]... [--no-bos]
        [--chat chat|thinking [--reasoning-effort E]]

``--prompt`` is raw text (a completion, BOS first unless ``--no-bos``); ``--chat MODE`` makes it one user message
rendered by ``encoding.encode_messages`` in MODE, as the reference's chat prompts are (SPEC §13-14): BOS, the
effort line in thinking mode, ``<｜User｜>TEXT<｜Assistant｜>`` and ``</think>`` (chat) or ``<think>`` (thinking).
``--temperature`` defaults to config.json's ``temperature`` (1.0 where the file has none, the reference
generate.py's default; the fixtures' and train/run.py's exports say 0.0, greedy).
"""
from __future__ import annotations

import argparse
import math
import numbers
import operator
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import optree
import torch

from .config import Config, require_config
from .dspark import dspark_draft, dspark_prefill, probs, sample_logits
from .model import forward
from .pytree import tree_nbytes
from .speculative import accept_greedy, accept_sampling, leading, residual, rollback
from .state import check_state_fits, device_problem, init_state, positive_int
from .validate import _check_params


class GenerateResult(list):
    """A list (one per prompt) of generated token-id lists, plus ``stats``: a dict with ``new_tokens``,
    ``stop`` (per row: "eos" / "length"), ``main_forwards`` (verify/decode forwards, prefill excluded),
    ``reruns`` (speculative rollbacks that re-ran accepted tokens), ``tokens_per_forward`` (speculative:
    mean tokens committed per verify forward), ``seconds``."""
    stats: dict


def _token_id(t, vocab_size: int) -> Optional[int]:
    """t as a token id (Python, numpy or 0-d torch integer in [0, vocab_size)), else None."""
    if isinstance(t, (bool, np.bool_)):
        return None
    try:
        t = operator.index(t)
    except TypeError:
        return None
    return t if 0 <= t < vocab_size else None


def _seed_range_error(seed: int) -> Optional[str]:
    """None where ``torch.Generator.manual_seed`` takes the integer ``seed`` (outside [-2**63, 2**64) it raises
    "Overflow when unpacking long long"), else why not. The one range: generate() and the CLI's --seed share it."""
    return None if -2**63 <= seed < 2**64 else f"must be in [-2**63, 2**64), got {seed}"


def _prep_prompts(prompts, cfg: Config, max_new_tokens: int, max_seq_len: Optional[int]):
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        prompts = [prompts] if prompts.ndim <= 1 else list(prompts)     # 0-d: refused below, with a hint
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("generate: prompts must be a non-empty list of token-id sequences")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (torch.Tensor, np.ndarray)) and p.ndim == 1:
            p = p.tolist()
        elif (isinstance(p, (str, bytes, bytearray, memoryview, torch.Tensor, np.ndarray))
              or not isinstance(p, Sequence)):   # a set or a dict has no token order (a dict gave its keys)
            hint = " - for a single prompt pass [ids]" if _token_id(p, 1 << 62) is not None else ""
            raise ValueError(f"generate: prompts must be a list of token-id lists (one list per prompt); "
                             f"prompt {i} is {p!r}{hint}")
        else:
            p = list(p)
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty (a prompt needs at least one token, e.g. BOS)")
        ids = [_token_id(t, cfg.vocab_size) for t in p]
        if None in ids:
            bad = p[ids.index(None)]
            raise ValueError(f"generate: prompt {i} holds {bad!r}, not a token id "
                             f"(an integer in [0, {cfg.vocab_size}))")
        out.append(ids)
    max_new_tokens = positive_int("generate", "max_new_tokens", max_new_tokens)
    if max_seq_len is not None:
        max_seq_len = positive_int("generate", "max_seq_len", max_seq_len)
    total = max(len(p) for p in out) + max_new_tokens
    if max_seq_len is not None and total > max_seq_len:
        raise ValueError(f"generate: the longest prompt ({max(len(p) for p in out)}) + max_new_tokens "
                         f"({max_new_tokens}) = {total} runs past max_seq_len {max_seq_len}")
    return out, total


def generate(params: dict, prompts, *, cfg: Config, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, eos_id: Optional[int] = None, seed: int = 0, speculative: bool = False,
             max_seq_len: Optional[int] = None, stream: Optional[Callable[[list], None]] = None,
             mode: str = "reference", impl: Optional[str] = None, dispatch: str = "sorted",
             images=None, token_types=None) -> GenerateResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    prompts: list of token-id lists (Python / numpy / torch integers; or 1-D tensors or arrays, or one
    [b, s] tensor or array); temperature 0 = greedy, else
    sampling from softmax(logits / T) restricted to the top-p nucleus (``dspark.probs``) with a
    ``torch.Generator`` seeded by ``seed``; eos_id: a row stops when it samples it (not included);
    speculative: DSpark draft + one verify forward per step (needs ``cfg.n_mtp_layers`` and ``params["mtp"]``),
    greedy output identical to plain greedy, sampling distribution unchanged; max_seq_len: state
    capacity (default: longest prompt + max_new_tokens); stream: called after every step with a list
    (one per row) of the token ids committed in that step. ``dispatch``: the MoE formulation
    (``forward``'s): "sorted" (one GEMM per active expert) reads the expert counts on the host once
    per MoE layer; "dense" needs no host read at all, so a decode step then synchronises only for
    the stop check (small expert counts). ``images`` / ``token_types``: as ``forward``'s batch entries for
    the prompts (token_types per row, prompt length each); every image span must lie inside the first
    prefill chunk (the shortest prompt), as in the reference. Returns a ``GenerateResult``.
    """
    require_config(cfg, "generate")
    _check_params(params, cfg, "generate")      # before reading params' device, Engram map or stages
    prompts, total = _prep_prompts(prompts, cfg, max_new_tokens, max_seq_len)
    if stream is not None and not callable(stream):
        raise TypeError(f"generate: stream must be a callable (called with each step's tokens), got "
                        f"{type(stream).__name__}")
    if not sampling_ok(temperature, top_p):
        raise ValueError(f"generate: need temperature >= 0 and 0 < top_p <= 1, got {temperature!r}, {top_p!r}")
    if cfg.engram_layer_ids and "engram_token_map" not in params:
        raise ValueError("generate: the config has Engram layers but params lack 'engram_token_map' "
                         "(fd.load_params builds it from the checkpoint's tokenizer.json)")
    if not isinstance(speculative, (bool, np.bool_)):      # "no" and 0.5 used to mean True
        raise ValueError(f"generate: speculative must be True or False, got {speculative!r}")
    if speculative and (cfg.n_mtp_layers < 1 or len(params.get("mtp", ())) != cfg.n_mtp_layers):
        raise ValueError("generate: speculative=True needs DSpark stages (cfg.n_mtp_layers and params['mtp'])")
    if eos_id is not None:                       # a float eos_id (2.5) never matched, True matched token 1
        eos = _token_id(eos_id, cfg.vocab_size)
        if eos is None:
            raise ValueError(f"generate: eos_id {eos_id!r} is not a token id (an integer in [0, {cfg.vocab_size}))")
        eos_id = eos
    try:                                         # int(seed) truncated 1.5 to 1 silently
        seed = operator.index(seed)
    except TypeError:
        raise ValueError(f"generate: seed must be an integer, got {seed!r}") from None
    if (why := _seed_range_error(seed)) is not None:
        raise ValueError(f"generate: seed {why}")
    dev = params["embed"]["weight"].device
    b = len(prompts)
    check_state_fits(cfg, b, max_seq_len or total, device=dev, who="generate")   # before any allocation
    state = init_state(cfg, b, max_seq_len or total, device=dev)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    tokens = torch.zeros(b, total, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    in_prompt = torch.arange(total, device=dev)[None] < lens[:, None]             # [b, total]
    first = {}
    if images is not None or token_types is not None:
        first = _image_batch(prompts, images, token_types, int(lens.min()), cfg, dev)
    g = torch.Generator(device=dev).manual_seed(int(seed))
    kw = dict(mode=mode, impl=impl, dispatch=dispatch)
    t0 = time.perf_counter()
    run = _speculative if speculative else _plain
    with torch.no_grad():    # tokens are discrete: with params that require grad, no step's graph is kept
        stats = run(params, cfg, state, tokens, in_prompt, lens, total, max_new_tokens, temperature, top_p,
                    eos_id, g, stream, kw, first)
    res = GenerateResult()
    toks, n_out = tokens.tolist(), stats.pop("n_out").tolist()
    for i in range(b):
        res.append(toks[i][len(prompts[i]):len(prompts[i]) + n_out[i]])
    stats["seconds"] = time.perf_counter() - t0
    stats["new_tokens"] = [len(r) for r in res]
    res.stats = stats
    return res


def _real(x) -> bool:
    """A finite real number (not a bool, NaN or inf): a NaN temperature would sample garbage silently."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def sampling_ok(temperature, top_p) -> bool:
    """The sampling settings generate and dspark_draft accept: temperature >= 0 (0 = greedy), 0 < top_p <= 1,
    both finite reals."""
    return _real(temperature) and _real(top_p) and temperature >= 0 and 0 < top_p <= 1


def _image_batch(prompts, images, token_types, n0, cfg, dev) -> dict:
    """Batch entries of the first (prefill) chunk for image prompts; refuses spans past that chunk and
    image spans without images (either one alone would silently run the image tokens as text)."""
    if token_types is None:
        raise ValueError("generate: images need token_types (image_processor.expand_image_tokens gives both)")
    if not hasattr(token_types, "__len__") or isinstance(token_types, (str, bytes)):
        raise ValueError(f"generate: token_types must hold one row per prompt (a list, or a [b, s] tensor), "
                         f"got {type(token_types).__name__}")
    if len(token_types) != len(prompts):
        raise ValueError(f"generate: token_types has {len(token_types)} rows for {len(prompts)} prompts")
    rows = []
    for i, (p, t) in enumerate(zip(prompts, token_types)):
        t = torch.as_tensor(t)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:    # a cast truncated 0.5 to 0 silently
            raise ValueError(f"generate: token_types row {i} must hold integers (-1 text, 0..3 image span), "
                             f"got {t.dtype}")
        t = t.long()
        if t.shape != (len(p),):
            raise ValueError(f"generate: token_types row {i} has shape {tuple(t.shape)}, its prompt {len(p)} tokens")
        if images is None and bool((t >= 0).any()):
            raise ValueError(f"generate: token_types row {i} marks image positions (>= 0) but no images were given")
        if bool((t[n0:] >= 0).any()):
            raise ValueError(f"generate: row {i} has image tokens past position {n0} (the shortest prompt); "
                             "image spans must lie in the first prefill chunk")
        rows.append(t[:n0])
    return {"token_types": torch.stack(rows).to(dev), "images": images}


def _commit(tokens, in_prompt, lens, pos, new, done, n_out, eos_id, max_new):
    """Write the token of position ``pos`` for every row ([b] ``new``, prompt tokens win) and update the
    stop flags. Returns (done, n_out, written [b] tokens, emitted [b] bool)."""
    forced = in_prompt[:, pos]
    tok = torch.where(forced, tokens[:, pos], new)
    emitted = ~forced & ~done
    hit_eos = emitted & (tok == eos_id) if eos_id is not None else torch.zeros_like(done)
    tokens[:, pos] = tok
    n_out = n_out + (emitted & ~hit_eos).long()
    done = done | hit_eos | (emitted & (pos + 1 - lens >= max_new))
    return done, n_out, tok, emitted & ~hit_eos


def _plain(params, cfg, state, tokens, in_prompt, lens, total, max_new, T, top_p, eos_id, g, stream, kw, first):
    b = tokens.shape[0]
    pos = int(lens.min())
    out = forward(params, {"input_ids": tokens[:, :pos], **first}, cfg=cfg, state=state, **kw)
    done = torch.zeros(b, dtype=torch.bool, device=tokens.device)
    n_out = torch.zeros(b, dtype=torch.long, device=tokens.device)
    n_fwd = 0
    while True:
        nxt = sample_logits(out.logits[:, -1], T, top_p, g)
        done, n_out, tok, emitted = _commit(tokens, in_prompt, lens, pos, nxt, done, n_out, eos_id, max_new)
        if stream is not None:
            stream([[t] if e else [] for t, e in zip(tok.tolist(), emitted.tolist())])
        if pos + 1 >= total or bool(done.all()):                       # the one host sync per step
            break
        out = forward(params, {"input_ids": tok[:, None]}, cfg=cfg, state=out.state, validate=False, **kw)
        n_fwd += 1
        pos += 1
    return {"n_out": n_out, "stop": _stops(done, n_out, max_new), "main_forwards": n_fwd}


def _stops(done, n_out, max_new):
    return ["length" if n >= max_new or not d else "eos" for d, n in zip(done.tolist(), n_out.tolist())]


def _speculative(params, cfg, state, tokens, in_prompt, lens, total, max_new, T, top_p, eos_id, g, stream, kw,
                 first):
    """Draft B tokens, verify [last, d_1..d_B] in one forward, commit the accepted prefix + 1 token."""
    b, dev = tokens.shape[0], tokens.device
    B = cfg.dspark_block_size
    q = int(lens.min())                                                # position of `last`
    out = forward(params, {"input_ids": tokens[:, :q], **first}, cfg=cfg, state=state, **kw)
    state = dspark_prefill(params, out.main_hidden, cfg=cfg, state=out.state, mode=kw["mode"],
                           impl=kw["impl"])
    mh_last = out.main_hidden[:, -1:]
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    n_out = torch.zeros(b, dtype=torch.long, device=dev)
    done, n_out, last, emitted = _commit(tokens, in_prompt, lens, q, sample_logits(out.logits[:, -1], T, top_p, g),
                                         done, n_out, eos_id, max_new)
    if stream is not None:
        stream([[t] if e else [] for t, e in zip(last.tolist(), emitted.tolist())])
    n_fwd = reruns = committed = 0
    while q + 1 < total and not bool(done.all()):
        Be = min(B, total - 1 - q)                                     # block positions q+1 .. q+Be
        d = dspark_draft(params, last, mh_last, cfg=cfg, state=state, temperature=T, top_p=top_p, generator=g,
                         mode=kw["mode"], impl=kw["impl"], dispatch=kw["dispatch"], validate=False)  # ids: ours
        forced = in_prompt[:, q + 1:q + 1 + Be]
        blk = torch.where(forced, tokens[:, q + 1:q + 1 + Be], d.out_ids[:, 1:1 + Be])
        chunk = torch.cat([last[:, None], blk], 1)
        v = forward(params, {"input_ids": chunk}, cfg=cfg, state=d.state, validate=False, **kw)
        n_fwd += 1
        if T <= 0:
            ok = accept_greedy(v.logits, blk, forced)
        else:
            p_main = probs(v.logits, T, top_p)                         # [b, Be+1, V]
            q_draft = probs(d.logits[:, :Be], T, top_p)
            ok = accept_sampling(p_main[:, :Be], q_draft, blk, forced, g)
        a = leading(ok)
        n = int(torch.where(done, Be, a).min())                        # accepted drafts, common to all rows
        # the token at position q+n+1: forced prompt token / accepted draft / main-model correction
        if T <= 0:
            fix = v.logits[:, n].argmax(-1)
        else:
            dist = p_main[:, n] if n == Be else residual(p_main[:, n], q_draft[:, n])
            fix = torch.multinomial(dist, 1, generator=g)[:, 0]
        if n < Be:
            fix = torch.where(a > n, blk[:, n], fix)
        step_toks = [[] for _ in range(b)]
        for i in range(n):
            done, n_out, tok, em = _commit(tokens, in_prompt, lens, q + 1 + i, blk[:, i], done, n_out, eos_id, max_new)
            _note(step_toks, tok, em, stream)
        new_pos = q + n + 1
        if new_pos < total:
            done, n_out, last, em = _commit(tokens, in_prompt, lens, new_pos, fix, done, n_out, eos_id, max_new)
            _note(step_toks, last, em, stream)
        if stream is not None:
            stream(step_toks)
        committed += n + 1 if new_pos < total else n                    # no room for the bonus at the length limit
        state, rr = rollback(params, d.state, v.state, chunk[:, :n + 1], cfg=cfg, forward_kw=kw)
        reruns += rr
        state = dspark_prefill(params, v.main_hidden[:, :n + 1], cfg=cfg, state=state, mode=kw["mode"],
                               impl=kw["impl"])
        mh_last = v.main_hidden[:, n:n + 1]
        q = new_pos
    return {"n_out": n_out, "stop": _stops(done, n_out, max_new), "main_forwards": n_fwd, "reruns": reruns,
            "tokens_per_forward": committed / max(n_fwd, 1)}


def _note(step_toks, tok, emitted, stream):
    if stream is None:
        return
    for r, (t, e) in enumerate(zip(tok.tolist(), emitted.tolist())):
        if e:
            step_toks[r].append(t)


def _textless_ids(tok, vocab_size: int) -> frozenset:
    """The ids in [0, vocab_size) that ``tok`` has no token for: a padded vocabulary (the release's config.json
    has more ids than its tokenizer.json) or a tokenizer.json that does not belong to the config. The model can
    emit them; ``tok.decode`` drops them from the text silently."""
    known = set(tok.get_vocab(with_added_tokens=True).values())
    return frozenset(range(vocab_size)) - known


def _textless_note(tok, vocab_size: int, textless: frozenset, ckpt) -> str:
    """The CLI's one stderr line about ids without text (printed when the first one is generated)."""
    return (f"the model generated token id(s) that {Path(ckpt) / 'tokenizer.json'} has no text for: config.json's "
            f"vocab_size is {vocab_size}, the tokenizer has {tok.get_vocab_size()} ids, {len(textless)} of the "
            f"model's ids have no token; each is shown as <id N>")


def _render(tok, ids: Sequence[int], textless) -> str:
    """The text of ``ids`` as the CLI streams it: the tokenizer's decoding (special tokens kept), except that an id
    in ``textless`` (see ``_textless_ids``), which ``tok.decode`` would drop silently, is shown as ``<id N>``.
    Runs of decodable ids are decoded together (a multi-byte character spans tokens), so without textless ids this
    is ``tok.decode(ids, skip_special_tokens=False)``."""
    if not textless:        # every id the model can emit has a token (the CLI renders the whole text every step:
        return tok.decode(list(ids), skip_special_tokens=False)     # no per-id Python pass on the common path)
    from .train.tokenizer import decode
    parts, run = [], []
    for i in ids:
        if i in textless:
            if run:
                parts.append(decode(tok, run, skip_special_tokens=False))
                run = []
            parts.append(f"<id {i}>")
        else:
            run.append(i)
    if run or not parts:
        parts.append(decode(tok, run, skip_special_tokens=False))
    return "".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: load a released-layout folder, tokenize ``--prompt``, stream the decoded text, print tokens/s."""
    ap = argparse.ArgumentParser(prog="python -m functional_dsv41.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True, help="folder with config.json, *.safetensors, tokenizer.json")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=None,
                    help="0 = greedy; default: config.json's temperature, else 1.0 (the reference generate.py's)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", action="store_true", help="DSpark draft + one verify forward per step")
    ap.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token (id 0)")
    ap.add_argument("--chat", choices=("chat", "thinking"), default=None,
                    help="render --prompt as one user message of a chat in this mode (encoding.encode_messages: "
                         "BOS, <｜User｜>TEXT<｜Assistant｜> and </think> or <think>); default: raw text")
    ap.add_argument("--reasoning-effort", default=None, metavar="E",
                    help="--chat thinking: 1-100, low, high (the default) or max")
    ap.add_argument("--image", action="append", default=[], metavar="FILE",
                    help="an image (PNG; other formats with Pillow) for each image token in the prompt, in "
                         "order; with no image token in the prompt one is put before the text")
    ap.add_argument("--device", default="cpu", help="where the model runs: cpu (the default), cuda or cuda:N")
    args = ap.parse_args(argv)

    def fail(msg: str) -> int:                  # bad input: one line and exit status 2, as argparse does
        print(f"error: {msg}", file=sys.stderr)
        return 2

    if args.max_new_tokens < 1:
        return fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if (why := device_problem(args.device)) is not None:     # before minutes of loading
        return fail(f"--device {args.device!r}: {why}")
    if args.temperature is not None and (not math.isfinite(args.temperature) or args.temperature < 0):
        return fail(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        return fail(f"--top-p must be in (0, 1], got {args.top_p}")
    if (why := _seed_range_error(args.seed)) is not None:     # generate's own check, before the echo
        return fail(f"--seed {why}")
    prompt = args.prompt
    if args.chat is None and args.reasoning_effort is not None:
        return fail("--reasoning-effort needs --chat thinking")
    if args.chat is not None:
        from .encoding import IMAGE, encode_messages
        if args.no_bos:
            return fail("--no-bos: a --chat prompt starts with BOS (encoding.encode_messages)")
        if args.chat == "chat" and args.reasoning_effort is not None:
            return fail("--reasoning-effort needs --chat thinking (chat mode has no effort line)")
        effort = args.reasoning_effort
        if effort is not None and effort.lstrip("-").isdigit():
            effort = int(effort)
        text = prompt if IMAGE in prompt or not args.image else IMAGE * len(args.image) + prompt
        try:
            prompt = encode_messages([{"role": "user", "content": text}], args.chat, reasoning_effort=effort)
        except ValueError as e:                  # a bad effort
            return fail(f"--reasoning-effort: {e}")
    for f in args.image:
        if not Path(f).is_file():
            return fail(f"--image {f}: " + ("a directory, not an image file" if Path(f).is_dir() else "no such file"))
    ck = Path(args.ckpt)
    if not (ck / "config.json").is_file() or not (ck / "tokenizer.json").is_file():
        return fail(f"{ck} needs config.json and tokenizer.json")
    try:
        cfg = Config.from_json(ck / "config.json")
    except ValueError as e:                      # ConfigError
        return fail(str(e))
    temperature = cfg.temperature if args.temperature is None else args.temperature
    if args.speculative and cfg.n_mtp_layers < 1:
        return fail(f"--speculative needs DSpark draft stages, and {ck}'s config has none (n_mtp_layers = 0; "
                    f"train/run.py's tiny preset trains none: use --config tiny-dspark)")
    pics = []
    if args.image:
        from .image_processor import load_image
        if not cfg.vision_enabled:
            return fail(f"--image: the checkpoint's config has no vision tower (vision_n_layers = "
                        f"{cfg.vision_n_layers})")
        for f in args.image:
            try:
                pics.append(load_image(Path(f).read_bytes(), cfg))
            except Exception as e:               # whatever the decoder says about a file it cannot read
                return fail(f"--image {f}: cannot read it as an image ({type(e).__name__}: {e})")

    from tokenizers import Tokenizer

    from .params import load_params
    try:
        tok = Tokenizer.from_file(str(ck / "tokenizer.json"))
    except Exception as e:                       # the tokenizers library raises a bare Exception
        return fail(f"{ck / 'tokenizer.json'}: cannot read it as a tokenizer ({e})")
    try:
        params = load_params(ck, cfg)
    except (ValueError, OSError) as e:           # CheckpointError and unreadable files
        return fail(str(e))
    if args.device != "cpu":                     # generate runs where the params are
        dev = torch.device(args.device)
        try:
            params = optree.tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, params)
        except torch.OutOfMemoryError:
            need = tree_nbytes(params)
            return fail(f"--device {args.device}: the checkpoint's params ({need / 2**30:.2f} GiB) do not fit in its "
                        f"memory")
    ids = tok.encode(prompt, add_special_tokens=False).ids
    beyond = sorted({i for i in ids if i >= cfg.vocab_size})
    if beyond:                                   # generate would refuse them, after the prompt was echoed
        return fail(f"the prompt encodes to token id(s) {beyond[:5]} outside the model's vocabulary (vocab_size "
                    f"{cfg.vocab_size}): {ck / 'tokenizer.json'} does not belong to this config.json")
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    images = token_types = None
    if args.image:
        from .image_processor import expand_image_tokens
        if cfg.image_token_id not in ids:
            ids = [cfg.image_token_id] * len(args.image) + ids
        try:
            ids, types = expand_image_tokens(ids, [grid for _, grid in pics], cfg)
        except ValueError as e:                  # image tokens in the prompt vs --image count
            return fail(str(e))
        ids = ids.tolist()
    if not args.no_bos and bos is not None and args.chat is None:     # (a chat prompt has its own)
        ids = [bos] + ids
    if args.image:
        token_types = [[-1] * (len(ids) - len(types)) + types.tolist()]
        images = [pics]
    if not ids:
        return fail("the prompt encodes to no tokens")
    sofar: list[int] = []
    shown = [""]
    textless = _textless_ids(tok, cfg.vocab_size)   # ids the model can emit that tokenizer.json has no token for
    told = [False]

    def stream(step):
        sofar.extend(step[0])
        if textless and not told[0] and any(i in textless for i in step[0]):
            sys.stdout.flush()
            print(f"\nnote: {_textless_note(tok, cfg.vocab_size, textless, ck)}", file=sys.stderr, flush=True)
            told[0] = True
        text = _render(tok, sofar, textless)
        if not text.endswith("\ufffd"):                          # wait for a whole UTF-8 character
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    try:                                         # before the prompt is echoed: a state that cannot fit
        check_state_fits(cfg, 1, len(ids) + args.max_new_tokens, device=params["embed"]["weight"].device,
                         who="--max-new-tokens")
    except ValueError as e:
        return fail(str(e))
    sys.stdout.write(prompt)                     # (--chat: the rendered prompt the model reads)
    res = generate(params, [ids], cfg=cfg, max_new_tokens=args.max_new_tokens, temperature=temperature,
                   top_p=args.top_p, eos_id=eos, seed=args.seed, speculative=args.speculative,
                   max_seq_len=len(ids) + args.max_new_tokens, stream=stream, images=images,
                   token_types=token_types)
    st = res.stats
    n = st["new_tokens"][0]
    line = f"\n[{n} tokens in {st['seconds']:.2f} s: {n / max(st['seconds'], 1e-9):.2f} tokens/s, stop: {st['stop'][0]}"
    if args.speculative:
        line += (f"; {st['tokens_per_forward']:.2f} tokens per verify forward, "
                 f"{st['main_forwards']} verify forwards, {st['reruns']} rollback re-runs")
    print(line + "]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
