"""fd.generate: golden greedy tokens, batched == single, speculative == plain greedy, eos, sampling,
the acceptance rule's distribution, bad input, and the CLI."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41 import speculative as spec

from conftest import REPO, fixture_dir, golden, skip_off_golden_trajectory


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fixture_model():
    d = fixture_dir("tiny-bf16")
    cfg = fd.Config.from_json(d / "config.json")
    return cfg, fd.load_params(d, cfg), golden("tiny-bf16")


def random_model(seed=0, peaked=False):
    """Config.tiny with random weights. ``peaked``: head rows of tokens 5..8 scaled up, so the main
    model and the (shared-head) drafter often, not always, agree - speculation then accepts blocks."""
    cfg = fd.Config.tiny()
    params = fd.init_params(cfg, seed=seed)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    if peaked:
        w = params["head"]["weight"].clone()
        w[5:9] *= 12
        params["head"]["weight"] = w
    return cfg, params


def test_greedy_matches_golden(fixture_model):
    skip_off_golden_trajectory("tiny-bf16")
    cfg, params, g = fixture_model
    P = int(g["prefill_len"])
    res = fd.generate(params, g["input_ids"][:, :P], cfg=cfg, max_new_tokens=9)
    assert torch.equal(torch.tensor(res), g["generated_ids"])
    assert res.stats["stop"] == ["length", "length"] and res.stats["main_forwards"] == 8


def test_batched_equals_single_and_speculative_equals_greedy(fixture_model):
    cfg, params, g = fixture_model
    # this set used to fail: a bf16 tie in the indexer scores was broken differently by torch.topk in a
    # decode step and in a verify chunk / a batch (indexer._topk_first now breaks ties by index)
    prompts = [g["input_ids"][0, :23].tolist(), g["input_ids"][1, :30].tolist(), g["input_ids"][1, 2:9].tolist(),
               g["input_ids"][0, :12].tolist()]
    batched = fd.generate(params, prompts, cfg=cfg, max_new_tokens=10)
    for p, toks in zip(prompts, batched):
        assert fd.generate(params, [p], cfg=cfg, max_new_tokens=10)[0] == toks
    spec_b = fd.generate(params, prompts, cfg=cfg, max_new_tokens=10, speculative=True)
    assert list(spec_b) == list(batched)
    assert spec_b.stats["tokens_per_forward"] >= 1.0


def test_speculative_random_init_accepts_and_is_identical():
    cfg, params = random_model(peaked=True)
    prompts = [[0, 17, 33, 5, 250], [0, 99]]
    plain = fd.generate(params, prompts, cfg=cfg, max_new_tokens=14)
    fast = fd.generate(params, prompts, cfg=cfg, max_new_tokens=14, speculative=True)
    assert list(fast) == list(plain)
    st = fast.stats
    # some blocks were (partly) accepted: fewer verify forwards than tokens
    assert st["tokens_per_forward"] > 1.0 and st["main_forwards"] < plain.stats["main_forwards"], st
    cfg, params = random_model(seed=3)
    prompts = [[0, 1, 2, 3], [0, 7, 8, 9, 10, 11, 12]]
    assert list(fd.generate(params, prompts, cfg=cfg, max_new_tokens=8, speculative=True)) == \
        list(fd.generate(params, prompts, cfg=cfg, max_new_tokens=8))


def test_speculative_stats_count_committed_tokens():
    """tokens_per_forward * main_forwards = the tokens the verify steps committed (all but the first, which the
    prefill samples). A last block accepted whole at the length limit has no room for its bonus token."""
    cfg, params = random_model(peaked=True)
    for prompt in ([0, 17, 33, 5, 250], [0, 99], [0, 5, 6, 7]):
        for mx in range(1, 8):
            st = fd.generate(params, [prompt], cfg=cfg, max_new_tokens=mx, speculative=True).stats
            assert st["new_tokens"] == [mx]
            assert st["tokens_per_forward"] * st["main_forwards"] == pytest.approx(mx - 1), (prompt, mx, st)


def test_speculative_passes_dispatch_to_the_drafter(monkeypatch):
    """dispatch="dense" (no host reads of expert counts) reaches the DSpark stages' MoE too (a stage is a
    model.mhc_block, as a backbone layer is)."""
    from functional_dsv41 import model
    cfg, params = random_model()
    seen = []
    real = model.moe

    def spy(*a, dispatch="sorted", **kw):
        if cfg.is_dspark(kw["layer_id"]):
            seen.append(dispatch)
        return real(*a, dispatch=dispatch, **kw)

    monkeypatch.setattr(model, "moe", spy)
    fd.generate(params, [[0, 4, 5]], cfg=cfg, max_new_tokens=3, speculative=True, dispatch="dense")
    assert seen and set(seen) == {"dense"}


def test_eos_stops_each_row(fixture_model):
    skip_off_golden_trajectory("tiny-bf16")
    cfg, params, g = fixture_model
    P = int(g["prefill_len"])
    full = g["generated_ids"].tolist()                  # row 0: [248, 73, 256, ...], row 1: [231, 382, ...]
    eos = full[0][2]
    assert eos not in full[1][:6]
    for speculative in (False, True):
        res = fd.generate(params, g["input_ids"][:, :P], cfg=cfg, max_new_tokens=6, eos_id=eos,
                          speculative=speculative)
        assert res[0] == full[0][:2] and res[1] == full[1][:6]
        assert res.stats["stop"] == ["eos", "length"]


def test_sampling_is_seeded():
    cfg, params = random_model()
    kw = dict(cfg=cfg, max_new_tokens=6, temperature=0.8, top_p=0.9)
    a = fd.generate(params, [[0, 4, 5]], seed=1, **kw)
    assert a == fd.generate(params, [[0, 4, 5]], seed=1, **kw)
    assert a != fd.generate(params, [[0, 4, 5]], seed=2, **kw)
    s = fd.generate(params, [[0, 4, 5], [0, 6]], seed=1, speculative=True, **kw)
    assert [len(r) for r in s] == [6, 6] and all(0 <= t < cfg.vocab_size for r in s for t in r)


def test_rejection_rule_keeps_the_distribution():
    """One speculative position: draft d ~ q, keep it if u < p(d)/q(d), else draw from norm(max(p-q,0)).
    The emitted token must be distributed as p."""
    g = torch.Generator().manual_seed(0)
    V, N = 6, 200_000
    p = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.0, 0.25])
    q = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    d = torch.multinomial(q.expand(N, V), 1, replacement=True, generator=g)
    ok = spec.accept_sampling(p.expand(N, 1, V), q.expand(N, 1, V), d, torch.zeros(N, 1, dtype=torch.bool), g)
    fix = torch.multinomial(spec.residual(p, q).expand(N, V), 1, generator=g)
    out = torch.where(ok, d, fix)[:, 0]
    freq = torch.bincount(out, minlength=V).float() / N
    assert float((freq - p).abs().max()) < 0.005, freq
    assert abs(float(ok.float().mean()) - 0.45) < 0.01   # acceptance rate = sum min(p, q) = 0.45


def test_forced_block_tokens_are_accepted_by_fiat():
    """forced (prompt tokens inside a drafted block) are accepted whatever the main model says: greedy where the
    token is not the argmax, sampling where the main model gives it probability 0."""
    logits = torch.zeros(1, 3, 5)
    logits[0, 0, 2] = logits[0, 1, 4] = logits[0, 2, 0] = 1.0     # argmax per row: 2, 4, 0
    block = torch.tensor([[2, 1]])                                  # agrees, then disagrees (1 != 4)
    assert spec.accept_greedy(logits, block, torch.tensor([[False, False]])).tolist() == [[True, False]]
    assert spec.accept_greedy(logits, block, torch.tensor([[False, True]])).tolist() == [[True, True]]
    p = torch.tensor([[[0.0, 0.5, 0.5], [0.0, 0.5, 0.5]]])          # p(0) = 0: never accepted unless forced
    q = torch.full((1, 2, 3), 1 / 3)
    d = torch.tensor([[0, 0]])
    ok = spec.accept_sampling(p, q, d, torch.tensor([[True, False]]), torch.Generator().manual_seed(0))
    assert ok.tolist() == [[True, False]]


def test_residual_where_nothing_is_left_is_p():
    """norm(max(p - q, 0)); where p == q (e.g. top-p cut both to the same single token) p itself: generate samples
    the residual of every row at the first rejected position, so an all-zero row would fail torch.multinomial."""
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.3, 0.2]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.2, 0.6]])
    r = spec.residual(p, q)
    assert torch.equal(r[0], p[0])
    assert torch.allclose(r[1], torch.tensor([0.75, 0.25, 0.0]))
    torch.multinomial(r, 1, generator=torch.Generator().manual_seed(0))   # a valid distribution in every row


def test_bad_input():
    cfg, params = random_model()
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        fd.generate(params, [[0, 1], []], cfg=cfg, max_new_tokens=2)
    with pytest.raises(ValueError, match="non-empty list"):
        fd.generate(params, [], cfg=cfg, max_new_tokens=2)
    with pytest.raises(ValueError, match="runs past max_seq_len"):
        fd.generate(params, [[0] * 10], cfg=cfg, max_new_tokens=8, max_seq_len=16)
    with pytest.raises(ValueError, match="not a token id"):
        fd.generate(params, [[0, cfg.vocab_size]], cfg=cfg, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=0)
    no_map = {k: v for k, v in params.items() if k != "engram_token_map"}
    with pytest.raises(ValueError, match="engram_token_map"):
        fd.generate(no_map, [[0, 1]], cfg=cfg, max_new_tokens=2)
    with pytest.raises(ValueError, match="DSpark"):
        fd.generate({k: v for k, v in params.items() if k != "mtp"}, [[0, 1]], cfg=cfg, max_new_tokens=2,
                    speculative=True)


def test_a_state_that_cannot_fit_is_refused_before_allocating(monkeypatch):
    """init_state (and so generate) checks the state's size against the device's free memory first: a huge
    max_seq_len must be a clear ValueError, not an allocation failure deep in torch or the OOM killer."""
    from functional_dsv41 import state as st
    cfg, params = random_model()
    assert cfg.engram_layer_ids and cfg.n_mtp_layers          # every kind of buffer is counted
    for b, n in ((1, 16), (3, 64), (2, 100)):
        assert st.state_nbytes(cfg, b, n) == st.state_bytes(fd.init_state(cfg, b, n))
    with pytest.raises(ValueError, match=r"needs [0-9.]+ GiB, more than the [0-9.]+ GiB free on cpu"):
        fd.init_state(cfg, 1, 10**12)
    with pytest.raises(ValueError, match=r"^generate: a decode state .* GiB free on cpu; ask for fewer tokens"):
        fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=10**12)
    need = st.state_nbytes(cfg, 2, 64)                        # the boundary, with the free memory pinned
    monkeypatch.setattr(st, "free_bytes", lambda device=None: need - 1)
    with pytest.raises(ValueError, match="for 2 row"):
        fd.init_state(cfg, 2, 64)
    monkeypatch.setattr(st, "free_bytes", lambda device=None: need)
    assert fd.init_state(cfg, 2, 64).max_seq_len == 64


def test_cli_refuses_max_new_tokens_past_memory(capsys):
    import importlib
    gm = importlib.import_module("functional_dsv41.generate")
    rc = gm.main(["--ckpt", str(fixture_dir("tiny-bf16")), "--prompt", "hi", "--max-new-tokens", str(10**12)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""                              # nothing echoed, nothing generated
    assert err.startswith("error: --max-new-tokens: a decode state for 1 row(s) of") and "GiB free" in err


@pytest.mark.parametrize("speculative", [False, True])
def test_cli(speculative):
    d = fixture_dir("tiny-bf16")
    cmd = [sys.executable, "-m", "functional_dsv41.generate", "--ckpt", str(d), "--prompt", "Once upon a time",
           "--max-new-tokens", "5"] + (["--speculative"] if speculative else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time")
    last = r.stdout.strip().splitlines()[-1]
    assert "5 tokens in" in last and "tokens/s" in last, r.stdout
    assert ("tokens per verify forward" in last) == speculative


def test_generate_keeps_no_graph_for_params_that_require_grad():
    """Tokens are discrete, so generate runs without autograd: params that require grad (a notebook's
    training leaves) must not make every step save activations for a backward that never comes."""
    cfg, params = random_model()
    leaves = [t for t in torch.utils._pytree.tree_leaves(params)
              if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.bfloat16)]
    for t in leaves:
        t.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = fd.generate(params, [[0, 4, 5]], cfg=cfg, max_new_tokens=3, speculative=False)
    assert len(out[0]) == 3 and saved == []
    assert any(t.requires_grad for t in leaves)


@pytest.mark.parametrize("config_temp,argv,expected", [
    (None, [], 1.0),                         # absent from config.json: the reference generate.py's default
    (0.7, [], 0.7),                          # config.json's value
    (0.7, ["--temperature", "0"], 0.0),      # the flag wins
])
def test_cli_temperature_defaults_to_the_config(tmp_path, monkeypatch, config_temp, argv, expected):
    import importlib
    import json
    gm = importlib.import_module("functional_dsv41.generate")
    src = fixture_dir("tiny-bf16")
    for f in src.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    conf = json.loads((src / "config.json").read_text())
    conf.pop("temperature", None)
    if config_temp is not None:
        conf["temperature"] = config_temp
    (tmp_path / "config.json").write_text(json.dumps(conf))
    seen = {}

    class Stop(Exception):
        pass

    def spy(*a, **kw):
        seen.update(kw)
        raise Stop
    monkeypatch.setattr(gm, "generate", spy)
    with pytest.raises(Stop):
        gm.main(["--ckpt", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "2", *argv])
    assert seen["temperature"] == expected


def test_seed_range_is_one_definition(monkeypatch, capsys):
    """generate()'s seed check and the CLI's pre-echo --seed check read ONE definition of the range that
    torch.Generator takes (it was written out twice, free to drift apart): narrowed, both refuse by it; as it is,
    both take its ends and refuse just past them."""
    import importlib
    gm = importlib.import_module("functional_dsv41.generate")
    cfg, params = random_model()
    ckpt = str(fixture_dir("tiny-bf16"))
    seen = []

    class Stop(Exception):
        pass

    def spy(*a, seed, **kw):                     # the CLI got past its own checks and called generate
        seen.append(seed)
        raise Stop

    def cli_refuses(seed):
        with monkeypatch.context() as m:
            m.setattr(gm, "generate", spy)
            try:
                rc = gm.main(["--ckpt", ckpt, "--prompt", "hi", "--max-new-tokens", "1", "--seed", str(seed)])
            except Stop:
                capsys.readouterr()              # the echoed prompt
                return False
        out, err = capsys.readouterr()
        assert rc == 2 and out == "" and err.startswith("error: --seed "), (rc, out, err)
        return True

    def generate_refuses(seed):
        try:
            fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=1, temperature=1.0, seed=seed)
        except ValueError as e:
            assert str(e).startswith("generate: seed "), e
            return True
        return False

    for seed in (-2**63, 2**64 - 1, -2**63 - 1, 2**64):
        want = not -2**63 <= seed < 2**64
        assert generate_refuses(seed) == cli_refuses(seed) == want, seed
    # the one definition narrowed to [0, 8): both checks follow it
    monkeypatch.setattr(gm, "_seed_range_error", lambda s: None if 0 <= s < 8 else f"must be in [0, 8), got {s}")
    for seed, want in ((7, False), (8, True), (-1, True)):
        assert generate_refuses(seed) == cli_refuses(seed) == want, seed
    assert seen == [-2**63, 2**64 - 1, 7]


def test_render_shows_ids_the_tokenizer_has_no_text_for():
    """A padded vocabulary (config.json's vocab_size above the tokenizer's ids, as in the release): tok.decode drops
    the ids it has no token for, so the CLI's text lost them silently. _render shows each as <id N>, and is
    tok.decode(ids, skip_special_tokens=False) where every id has a token."""
    import importlib
    from functional_dsv41.train import tokenizer as T
    gm = importlib.import_module("functional_dsv41.generate")
    tok = T.load_tokenizer()
    n = tok.get_vocab_size()
    textless = gm._textless_ids(tok, n + 256)
    assert textless == frozenset(range(n, n + 256)) and gm._textless_ids(tok, n) == frozenset()
    assert tok.decode([5, n + 70, 7]) == tok.decode([5, 7])       # the library's silent drop
    assert gm._render(tok, [5, n + 70, 7, n + 143], textless) == \
        tok.decode([5]) + f"<id {n + 70}>" + tok.decode([7]) + f"<id {n + 143}>"
    assert gm._render(tok, [n], textless) == f"<id {n}>" and gm._render(tok, [], textless) == ""
    ids = tok.encode("<｜User｜>Once upon a time, a café 猫").ids              # a character spans byte tokens
    assert gm._render(tok, ids, textless) == tok.decode(ids, skip_special_tokens=False)
    assert gm._render(tok, ids[:-1], textless).endswith("\ufffd")          # (the CLI waits for the rest)


def test_cli_shows_generated_ids_without_text(tmp_path, monkeypatch, capsys):
    """The review's repro: a vocab_size=1024 checkpoint with the shipped 768-id tokenizer printed '[N tokens ...]'
    while ids 768..1023 produced no text. Now each shows as <id N> in the stream and one stderr note says why."""
    import importlib
    import shutil
    gm = importlib.import_module("functional_dsv41.generate")
    from functional_dsv41.train import tokenizer as T
    cfg = fd.Config.tiny().replace(vocab_size=1024, engram_layer_ids=(), engram_num_embeddings=())  # no Engram
    cfg.to_json(tmp_path / "config.json")
    fd.save_params(fd.init_params(cfg, seed=0), tmp_path, cfg)
    shutil.copy(T.TOKENIZER_JSON, tmp_path / "tokenizer.json")          # 768 ids; the model's 1024
    tok = T.load_tokenizer()
    steps = [[5], [838], [7], [911], [9]]

    def fake_generate(params, prompts, *, stream, **kw):
        for s in steps:
            stream([s])
        res = gm.GenerateResult([[t for s in steps for t in s]])
        res.stats = dict(new_tokens=[len(steps)], seconds=0.5, stop=["length"], main_forwards=len(steps) - 1)
        return res
    monkeypatch.setattr(gm, "generate", fake_generate)
    rc = gm.main(["--ckpt", str(tmp_path), "--prompt", "Once", "--max-new-tokens", str(len(steps))])
    out, err = capsys.readouterr()
    assert rc == 0, err
    text = out.split("\n[")[0]
    assert text == "Once" + tok.decode([5]) + "<id 838>" + tok.decode([7]) + "<id 911>" + tok.decode([9]), out
    assert err.count("note:") == 1 and "error" not in err, err
    assert (f"note: the model generated token id(s) that {tmp_path / 'tokenizer.json'} has no text for: config.json's "
            f"vocab_size is 1024, the tokenizer has 768 ids, 256 of the model's ids have no token; each is shown as "
            f"<id N>") in err, err
    # the real model on that checkpoint: every generated id is in the text, as itself or as <id N>
    monkeypatch.undo()
    seen = []
    real = gm.generate

    def spy(*a, **kw):
        res = real(*a, **kw)
        seen.extend(res[0])
        return res
    monkeypatch.setattr(gm, "generate", spy)
    assert gm.main(["--ckpt", str(tmp_path), "--prompt", "Once", "--max-new-tokens", "12", "--temperature", "1"]) == 0
    out, err = capsys.readouterr()
    textless = frozenset(range(768, 1024))
    full, shown = "Once" + gm._render(tok, seen, textless), out.split("\n[")[0]
    assert shown == full or (full.endswith("\ufffd") and full.startswith(shown)), (shown, full)   # (a partial char)
    assert ("note:" in err) == any(t in textless for t in seen)
