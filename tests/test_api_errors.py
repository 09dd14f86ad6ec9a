"""The public inference API refuses bad input with an error that names the problem: ``fd.generate``
is the function whatever the import order, images / token_types that cannot be honoured, generate's
prompt formats and the ``python -m functional_dsv41.generate`` CLI's arguments."""
from __future__ import annotations

import re
from pathlib import Path
import subprocess
import sys

import numpy as np
import pytest
import torch

import functional_dsv41 as fd

from conftest import REPO, fixture_dir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    cfg = fd.Config.tiny()                               # text only: vision_n_layers = 0
    params = fd.init_params(cfg, seed=0)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    return cfg, params


# ----------------------------------------------------------------------------- fd.generate is the function
@pytest.mark.parametrize("code", [
    # the submodule imported first: the import system binds it as the package attribute `generate`
    "import functional_dsv41 as fd\nfrom functional_dsv41.generate import GenerateResult\n"
    "import functional_dsv41.generate",
    # the function looked up first, the submodule imported after
    "import functional_dsv41 as fd\nf = fd.generate\nimport functional_dsv41.generate\nassert fd.generate is f",
])
def test_fd_generate_is_the_function_whatever_the_import_order(code):
    check = ("\nimport types\nassert isinstance(fd.generate, types.FunctionType), type(fd.generate)"
             "\nfrom functional_dsv41 import generate\nassert generate is fd.generate"
             "\nassert sys.modules['functional_dsv41.generate'].GenerateResult")
    r = subprocess.run([sys.executable, "-c", "import sys\n" + code + check], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------- forward: images / token_types
def _span_batch(cfg, b=1):
    """A prompt with one 1x1-cell image span (START, IMAGE, NEW_LINE, END) at positions 1..4."""
    ids = torch.tensor([[0, cfg.image_token_id, cfg.image_token_id, cfg.image_token_id, cfg.image_token_id, 7]] * b)
    tt = torch.tensor([[-1, 0, 1, 2, 3, -1]] * b)
    return ids, tt


def test_images_on_a_model_without_vision_tower(model):
    cfg, params = model
    ids, tt = _span_batch(cfg)
    img = (torch.zeros(1, 3, cfg.vision_patch_size, cfg.vision_patch_size, dtype=torch.bfloat16), (1, 1))
    with pytest.raises(ValueError, match=r"no vision tower \(vision_n_layers = 0\).*batch\['images'\]"):
        fd.forward(params, {"input_ids": ids, "token_types": tt, "images": [[img]]}, cfg=cfg)
    # rows without images are plain text, as on a vision model
    text = torch.tensor([[0, 5, 6, 7]])
    assert torch.equal(fd.forward(params, {"input_ids": text, "images": [None],
                                           "token_types": torch.full_like(text, -1)}, cfg=cfg).logits,
                       fd.forward(params, {"input_ids": text}, cfg=cfg).logits)


def test_image_spans_without_images_are_refused(model):
    cfg, params = model
    ids, tt = _span_batch(cfg)
    with pytest.raises(ValueError, match=r"token_types marks image positions.*no 'images'"):
        fd.forward(params, {"input_ids": ids, "token_types": tt}, cfg=cfg)
    with pytest.raises(ValueError, match="marks image positions"):
        fd.generate(params, ids.tolist(), cfg=cfg, max_new_tokens=1, token_types=tt.tolist())
    # all-text token types stay fine
    fd.forward(params, {"input_ids": ids, "token_types": torch.full_like(tt, -1)}, cfg=cfg)


def test_generate_token_types_must_be_integers(model):
    """generate cast token_types to int64: a float row (0.5 where 0 was meant, or -1.0) was truncated silently, where
    forward refuses float token_types."""
    cfg, params = model
    ids, tt = _span_batch(cfg)
    for bad in (np.full((1, 6), -1.0), torch.full((1, 6), -1.0), [[-1.0, 0.5, 1.0, 2.0, 3.0, -1.0]], [[False] * 6]):
        with pytest.raises(ValueError, match="token_types row 0 must hold integers"):
            fd.generate(params, ids.tolist(), cfg=cfg, max_new_tokens=1, token_types=bad)
    text = torch.full_like(tt, -1)                          # integer rows (list, numpy, torch) still work
    ref = fd.generate(params, ids.tolist(), cfg=cfg, max_new_tokens=1)
    for ok in (text.tolist(), text.numpy(), text, text.int()):
        assert fd.generate(params, ids.tolist(), cfg=cfg, max_new_tokens=1, token_types=ok) == ref


def test_token_types_must_be_an_integer_tensor(model):
    cfg, params = model
    ids = torch.tensor([[0, 5, 6]])
    for bad in ([[-1, -1, -1]], torch.full((1, 3), -1.0)):
        for validate in (True, False):
            with pytest.raises(TypeError, match="token_types must be an integer tensor"):
                fd.forward(params, {"input_ids": ids, "token_types": bad}, cfg=cfg, validate=validate)
    with pytest.raises(ValueError, match=r"token_types \(1, 2\) must match input_ids \(1, 3\)"):
        fd.forward(params, {"input_ids": ids, "token_types": torch.tensor([[-1, -1]])}, cfg=cfg)


# ----------------------------------------------------------------------------- generate: prompt formats
def test_generate_accepts_numpy_and_torch_integer_ids(model):
    cfg, params = model
    ref = fd.generate(params, [[312, 5]], cfg=cfg, max_new_tokens=2)
    assert fd.generate(params, [np.array([312, 5])], cfg=cfg, max_new_tokens=2) == ref
    assert fd.generate(params, np.array([[312, 5]]), cfg=cfg, max_new_tokens=2) == ref
    assert fd.generate(params, [[np.int32(312), torch.tensor(5)]], cfg=cfg, max_new_tokens=2) == ref


def test_generate_prompt_refusals(model):
    cfg, params = model
    with pytest.raises(ValueError, match=r"list of token-id lists.*prompt 0 is 5.*\[ids\]"):
        fd.generate(params, [5, 6, 7], cfg=cfg, max_new_tokens=1)
    with pytest.raises(ValueError, match="list of token-id lists.*prompt 0 is 'hello'"):
        fd.generate(params, ["hello"], cfg=cfg, max_new_tokens=1)
    for bad in (1.0, True, 512, -1):
        with pytest.raises(ValueError, match=rf"prompt 0 holds {bad!r}, not a token id \(an integer in \[0, 512\)\)"):
            fd.generate(params, [[0, bad]], cfg=cfg, max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=True)
    for bad in ("no", 0.5, None):                    # "no" ran speculatively
        with pytest.raises(ValueError, match="speculative must be True or False"):
            fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=1, speculative=bad)
    for t, p in ((float("nan"), 1.0), (-1.0, 1.0), (1.0, float("nan")), (1.0, 0.0), ("1", 1.0)):
        with pytest.raises(ValueError, match="temperature >= 0 and 0 < top_p <= 1"):
            fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=1, temperature=t, top_p=p)
    # byte strings, sets and dicts are iterable but not token sequences: bytearray ran as its byte values, a set in
    # its hash order, a dict as its keys
    for bad in (bytearray(b"hi"), memoryview(b"hi"), {5, 3, 1}, {1: "a", 2: "b"}, iter([1, 2])):
        with pytest.raises(ValueError, match="list of token-id lists.*prompt 0 is"):
            fd.generate(params, [bad], cfg=cfg, max_new_tokens=1)
    assert fd.generate(params, [range(3), (0, 1, 2)], cfg=cfg, max_new_tokens=1)[0] == \
        fd.generate(params, [[0, 1, 2]], cfg=cfg, max_new_tokens=1)[0]


def test_generate_checks_params_before_reading_them(model):
    """generate read params' device, Engram map and stages first: None gave "argument of type 'NoneType' is not
    iterable", a tree without the embedding KeyError 'embed'. Now forward's own check names the problem."""
    cfg, params = model
    with pytest.raises(TypeError, match=r"generate: params must be the parameter tree .* got NoneType"):
        fd.generate(None, [[0, 1]], cfg=cfg, max_new_tokens=1)
    with pytest.raises(ValueError, match=r"generate: params do not match the config .*embed\.weight is missing"):
        fd.generate({k: v for k, v in params.items() if k != "embed"}, [[0, 1]], cfg=cfg, max_new_tokens=1)


def test_layers_held_as_a_dict_are_refused_by_name(model):
    """A ``layers`` dict keyed "0", "1", ... flattens to the same paths as the list, so the path check passed and
    forward failed with KeyError 0."""
    cfg, params = model
    batch = {"input_ids": torch.tensor([[1, 2]])}
    q = {**params, "layers": {str(i): layer for i, layer in enumerate(params["layers"])}}
    with pytest.raises(TypeError, match=r"forward: params\['layers'\] must be a list .* got dict"):
        fd.forward(q, batch, cfg=cfg)


@pytest.mark.parametrize("temperature, top_p", [(1e-45, 1.0), (1e-30, 1.0), (1.0, 1e-300), (1e-45, 1e-300)])
def test_extreme_sampling_settings_sample_the_argmax(model, temperature, top_p):
    """Settings sampling_ok accepts but fp32 cannot hold: logits / 1e-45 overflowed to inf (softmax NaN), and a
    top_p below fp32's smallest subnormal rounded to 0 and dropped every token; torch.multinomial then raised. Both
    limits are the argmax: the greedy tokens."""
    from functional_dsv41.dspark import probs
    cfg, params = model
    logits = torch.tensor([[0.5, 3.0, -2.0, 2.999]])
    pr = probs(logits, temperature, top_p)
    assert torch.equal(pr, torch.tensor([[0.0, 1.0, 0.0, 0.0]])), pr
    greedy = fd.generate(params, [[0, 1, 2]], cfg=cfg, max_new_tokens=3)
    assert fd.generate(params, [[0, 1, 2]], cfg=cfg, max_new_tokens=3, temperature=temperature, top_p=top_p) == greedy


# ----------------------------------------------------------------------------- the CLI
def _cli(capsys, *argv):
    from functional_dsv41.generate import main
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("args,msg", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "nan"], "--temperature must be >= 0"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    (["--image", "/nonexistent/pic.png"], "--image /nonexistent/pic.png: no such file"),
    (["--seed", str(10**23)], r"--seed must be in \[-2\*\*63, 2\*\*64\), got 1000"),
    (["--reasoning-effort", "high"], "--reasoning-effort needs --chat thinking"),
    (["--chat", "chat", "--reasoning-effort", "high"], "needs --chat thinking .chat mode has no effort line"),
    (["--chat", "thinking", "--reasoning-effort", "101"], "--reasoning-effort: reasoning_effort=101 is not valid"),
    (["--chat", "thinking", "--reasoning-effort", "medium"], "--reasoning-effort: reasoning_effort='medium'"),
    (["--chat", "chat", "--no-bos"], "--no-bos: a --chat prompt starts with BOS"),
    (["--device", "gpu"], "--device 'gpu': not a device"),
    (["--device", "cuda:64"], "--device 'cuda:64': (no CUDA device here|this machine has)"),
])
def test_cli_bad_arguments(capsys, args, msg):
    rc, err = _cli(capsys, "--ckpt", str(fixture_dir("tiny-bf16")), "--prompt", "hi", *args)
    assert rc == 2
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(msg, err), err


def test_cli_bad_arguments_echo_nothing(capsys):
    """Refused before the prompt is echoed (an out-of-range --seed was generate's traceback after the echo)."""
    from functional_dsv41.generate import main
    assert main(["--ckpt", str(fixture_dir("tiny-bf16")), "--prompt", "hi", "--seed", str(2**64)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: --seed") and "Traceback" not in err


def test_cli_tokenizer_beyond_the_vocabulary(capsys, tmp_path):
    """A tokenizer.json with more ids than config.json's vocab_size (a mismatched folder): a prompt that encodes to
    such an id was a traceback from generate after the echo; now one line naming the ids and the files."""
    import shutil
    cfg = fd.Config.tiny().replace(vocab_size=512, engram_layer_ids=(), engram_num_embeddings=())  # no Engram
    cfg.to_json(tmp_path / "config.json")
    fd.save_params(fd.init_params(cfg, seed=0), tmp_path, cfg)
    shutil.copy(Path(REPO) / "data" / "tokenizer.json", tmp_path / "tokenizer.json")   # 768 ids; the model's 512
    rc, err = _cli(capsys, "--ckpt", str(tmp_path), "--prompt", "<｜User｜>hi", "--max-new-tokens", "1")
    out = capsys.readouterr().out
    assert rc == 2 and out == "", out
    assert err.startswith("error: the prompt encodes to token id(s) [762] outside the model's vocabulary "
                          "(vocab_size 512)") and "does not belong to this config.json" in err, err


@pytest.mark.parametrize("mode,effort", [("chat", None), ("thinking", None), ("thinking", "max"), ("thinking", "20")])
def test_cli_chat_renders_one_user_message(capsys, monkeypatch, mode, effort):
    """--chat MODE: the prompt is encode_messages([user TEXT], MODE) tokenized (BOS once, from the template), and
    that rendered prompt is what the CLI echoes."""
    from tokenizers import Tokenizer
    import importlib
    gm = importlib.import_module("functional_dsv41.generate")
    from functional_dsv41.encoding import encode_messages
    d = fixture_dir("tiny-bf16")
    seen = {}

    class Stop(Exception):
        pass

    def spy(params, prompts, **kw):
        seen["ids"] = prompts[0]
        raise Stop
    monkeypatch.setattr(gm, "generate", spy)
    argv = ["--ckpt", str(d), "--prompt", "Once upon", "--chat", mode] + (["--reasoning-effort", effort] if effort else [])
    with pytest.raises(Stop):
        gm.main(argv)
    rendered = encode_messages([{"role": "user", "content": "Once upon"}], mode,
                               reasoning_effort=int(effort) if effort and effort.isdigit() else effort)
    assert rendered.endswith("<｜User｜>Once upon<｜Assistant｜>" + ("</think>" if mode == "chat" else "<think>"))
    if effort:
        assert f"Reasoning Effort: {dict(max=100).get(effort, effort)} " in rendered
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert seen["ids"] == tok.encode(rendered, add_special_tokens=False).ids
    assert seen["ids"][0] == 0 and seen["ids"][1] != 0          # BOS once
    assert capsys.readouterr().out == rendered


def test_cli_images(capsys, tmp_path):
    rc, err = _cli(capsys, "--ckpt", str(fixture_dir("tiny-vl")), "--prompt", "hi", "--image", str(tmp_path))
    assert rc == 2 and err.startswith(f"error: --image {tmp_path}: a directory, not an image file"), err
    junk = tmp_path / "notes.txt"
    junk.write_text("not an image")
    rc, err = _cli(capsys, "--ckpt", str(fixture_dir("tiny-vl")), "--prompt", "hi", "--image", str(junk))
    assert rc == 2 and err.startswith(f"error: --image {junk}: cannot read it as an image"), err
    rc, err = _cli(capsys, "--ckpt", str(fixture_dir("tiny-bf16")), "--prompt", "hi", "--image", str(junk))
    assert rc == 2 and "no vision tower (vision_n_layers = 0)" in err, err


def test_cli_unreadable_tokenizer(capsys, tmp_path):
    """A corrupt tokenizer.json was a traceback (a bare Exception from the tokenizers library, raised in load_params)."""
    import shutil
    src = fixture_dir("tiny-bf16")
    for f in ("config.json", "model.safetensors"):
        shutil.copy(src / f, tmp_path / f)
    (tmp_path / "tokenizer.json").write_text("{")
    rc, err = _cli(capsys, "--ckpt", str(tmp_path), "--prompt", "hi")
    assert rc == 2 and err.startswith(f"error: {tmp_path / 'tokenizer.json'}: cannot read it as a tokenizer"), err


def test_cli_speculative_needs_draft_stages(capsys, tmp_path):
    """The README's main job exports a model without DSpark stages: --speculative on it is an 'error:' line."""
    import json
    import shutil
    src = fixture_dir("tiny-bf16")
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["n_mtp_layers"] > 0
    cfg["compress_ratios"] = cfg["compress_ratios"][:len(cfg["compress_ratios"]) - cfg["n_mtp_layers"]]
    cfg["n_mtp_layers"] = 0
    for f in ("tokenizer.json", "model.safetensors"):
        shutil.copy(src / f, tmp_path / f)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, err = _cli(capsys, "--ckpt", str(tmp_path), "--prompt", "hi", "--speculative")
    assert rc == 2 and err.startswith("error: --speculative needs DSpark draft stages"), err


# ----------------------------------------------------------------------------- forward's batch
def test_forward_refuses_batch_keys_it_does_not_read(model):
    """A foreign or misspelt key was ignored: ``position_ids`` ran packed samples as one sequence, ``image`` ran
    text only. Also under validate=False (a host-only check)."""
    cfg, params = model
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    for key in ("position_ids", "image", "label"):
        for validate in (True, False):
            with pytest.raises(ValueError, match=f"does not read: \\['{key}'\\]"):
                fd.forward(params, {"input_ids": ids, key: torch.zeros(1, 8, dtype=torch.long)}, cfg=cfg,
                           validate=validate)
    # a training batch (train.data: input_ids, positions, labels) goes to forward as it is
    batch = {"input_ids": ids, "positions": torch.arange(8)[None], "labels": ids}
    assert torch.equal(fd.forward(params, batch, cfg=cfg).logits, fd.forward(params, {"input_ids": ids}, cfg=cfg).logits)


def test_forward_positions_must_be_integers(model):
    """Float positions were truncated to integers silently (input_ids of a float dtype are refused)."""
    cfg, params = model
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        fd.forward(params, {"input_ids": ids, "positions": torch.arange(8.0)[None] + 0.5}, cfg=cfg)
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        fd.forward(params, {"input_ids": ids, "positions": [list(range(8))]}, cfg=cfg)


def test_generate_eos_id_and_seed_must_be_integers(model):
    """eos_id=2.5 never matched a token (the rows ran to max_new_tokens), eos_id=True stopped at token 1, and
    seed=1.5 was truncated to 1: all silently."""
    cfg, params = model
    ref = fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=3)
    for bad in (2.5, float(ref[0][0]), True, "5", [5], -1, cfg.vocab_size):
        with pytest.raises(ValueError, match=r"eos_id .* is not a token id \(an integer in \[0, 512\)\)"):
            fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=3, eos_id=bad)
    for eos in (np.int64(ref[0][0]), torch.tensor(ref[0][0])):       # numpy and 0-d torch integers still work
        res = fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=3, eos_id=eos)
        assert res[0] == [] and res.stats["stop"] == ["eos"]
    for bad in (1.5, None, "1"):
        with pytest.raises(ValueError, match="seed must be an integer"):
            fd.generate(params, [[0, 1]], cfg=cfg, max_new_tokens=2, temperature=1.0, seed=bad)
    kw = dict(cfg=cfg, max_new_tokens=3, temperature=1.0)
    assert fd.generate(params, [[0, 1]], seed=np.int64(4), **kw) == fd.generate(params, [[0, 1]], seed=4, **kw)


def test_generate_refuses_a_0d_prompt(model):
    """A 0-d tensor or array as prompts was 'TypeError: iteration over a 0-d tensor' from inside torch."""
    cfg, params = model
    for bad in (torch.tensor(5), np.array(5)):
        with pytest.raises(ValueError, match=r"list of token-id lists.*prompt 0 is .*5.*\[ids\]"):
            fd.generate(params, bad, cfg=cfg, max_new_tokens=1)


# ----------------------------------------------------------------------------- params, config and seeds
def test_forward_checks_the_params_against_the_config(model):
    """A config changed without new params: every mismatched tensor named (it failed deep inside torch, with a
    KeyError, or ran on the params' own sizes, ignoring the config)."""
    cfg, params = model
    batch = {"input_ids": torch.tensor([[1, 2, 3]])}
    with pytest.raises(ValueError, match=r"params do not match the config \(\d+ problem\(s\)\): "
                                         r"layers\.0\.attn\.attn_sink is \(4,\), expected \(8,\)"):
        fd.forward(params, batch, cfg=cfg.replace(n_heads=8, o_groups=2))
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.0\.w1\.weight is \(32, 128\), expected \(64, 128\)"):
        fd.forward(params, batch, cfg=cfg.replace(moe_inter_dim=64))       # ran silently before
    with pytest.raises(ValueError, match=r"layers\.5\.engram\.embed\.weight is missing"):
        fd.forward(params, batch, cfg=cfg.replace(engram_layer_ids=(1, 5), engram_num_embeddings=(2514, 2712)))
    no_head = {k: v for k, v in params.items() if k != "head"}
    with pytest.raises(ValueError, match=r"head\.weight is missing"):
        fd.forward(no_head, batch, cfg=cfg)
    # master trees (no scales) and trees without the draft stages are what forward reads: accepted
    master = fd.init_params(cfg, seed=0, master=True)
    master["engram_token_map"] = params["engram_token_map"]
    assert fd.forward(master, batch, cfg=cfg).logits.shape == (1, 3, cfg.vocab_size)
    no_mtp = {k: v for k, v in params.items() if k != "mtp"}
    assert torch.equal(fd.forward(no_mtp, batch, cfg=cfg).logits, fd.forward(params, batch, cfg=cfg).logits)


def test_a_tree_that_passed_is_checked_again_after_any_leaf_changes(model, monkeypatch):
    """forward remembers a tree that passed the params check (the spec walk cost 0.6-0.9 s a call at the release's
    size, on every decode step): the same tree again skips the walk, and a leaf replaced, removed or added
    anywhere in it is checked again and refused."""
    import optree
    from functional_dsv41 import validate
    from functional_dsv41.pytree import OPTREE_NAMESPACE
    cfg, params = model
    tree = optree.tree_map(lambda t: t, params, namespace=OPTREE_NAMESPACE)   # the same tensors, new containers
    batch = {"input_ids": torch.tensor([[1, 2, 3]])}
    walks = []
    real_walk = validate._check_params_walk
    monkeypatch.setattr(validate, "_check_params_walk", lambda *a: (walks.append(1), real_walk(*a))[1])
    ref = fd.forward(tree, batch, cfg=cfg).logits
    fd.forward(tree, batch, cfg=cfg)
    assert len(walks) == 1                                  # the second call found the tree it had checked
    wq = tree["layers"][3]["attn"]["wq_a"]["weight"]
    tree["layers"][3]["attn"]["wq_a"]["weight"] = wq[:-1]   # in place, deep inside the same containers
    with pytest.raises(ValueError, match=r"layers\.3\.attn\.wq_a\.weight is \(\d+, \d+\), expected"):
        fd.forward(tree, batch, cfg=cfg)
    tree["layers"][3]["attn"]["wq_a"]["weight"] = wq.to(torch.int32)     # same shape, a dtype that is refused
    with pytest.raises(ValueError, match=r"layers\.3\.attn\.wq_a\.weight"):
        fd.forward(tree, batch, cfg=cfg)
    tree["layers"][3]["attn"]["wq_a"]["weight"] = wq
    n = len(walks)
    assert torch.equal(fd.forward(tree, batch, cfg=cfg).logits, ref)
    assert len(walks) == n                                  # leaf for leaf the tree that passed: not walked
    head = tree.pop("head")
    with pytest.raises(ValueError, match=r"head\.weight is missing"):
        fd.forward(tree, batch, cfg=cfg)
    tree["head"] = head
    tree["layers"][0]["attn"]["extra"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.extra is not a parameter of this config"):
        fd.forward(tree, batch, cfg=cfg)
    del tree["layers"][0]["attn"]["extra"]
    n = len(walks)
    fd.forward(tree, batch, cfg=cfg)
    assert len(walks) == n
    fd.forward(tree, batch, cfg=cfg.replace(temperature=0.5))   # another config: checked for that config
    fd.forward(tree, batch, cfg=cfg)
    assert len(walks) == n + 1
    # a remembered leaf that dies drops the record: its address may come back as another tensor
    key = (cfg, id(tree))
    assert key in validate._PASSED
    tree["layers"][3]["attn"]["wq_a"]["weight"] = wq.clone()
    del wq
    import gc
    gc.collect()
    assert key in validate._PASSED                          # the old wq_a is still held by `params`
    old = tree["layers"][3]["attn"]["wq_a"]["weight"]
    fd.forward(tree, batch, cfg=cfg)                        # the clone: checked and remembered
    tree["layers"][3]["attn"]["wq_a"]["weight"] = params["layers"][3]["attn"]["wq_a"]["weight"]
    del old
    gc.collect()
    assert key not in validate._PASSED


def test_input_ids_type_and_rank_are_checked_even_without_validate(model):
    cfg, params = model
    with pytest.raises(TypeError, match="input_ids must be an integer tensor, got torch.float32"):
        fd.forward(params, {"input_ids": torch.tensor([[1.7, 2.9]])}, cfg=cfg, validate=False)   # ran as [[1, 2]]
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\], got shape \(1,\)"):
        fd.forward(params, {"input_ids": torch.tensor([3])}, cfg=cfg, validate=False)
    with pytest.raises(TypeError, match="input_ids must be a tensor, got list"):
        fd.forward(params, {"input_ids": [[1, 2]]}, cfg=cfg, validate=False)


@pytest.mark.parametrize("call", ["forward", "init_state", "init_params", "generate", "state_nbytes", "param_spec",
                                  "param_count_report"])
def test_cfg_must_be_a_config(model, call):
    cfg, params = model
    bad = cfg.to_dict()
    f = {"forward": lambda: fd.forward(params, {"input_ids": torch.tensor([[1]])}, cfg=bad),
         "init_state": lambda: fd.init_state(bad, 1),
         "init_params": lambda: fd.init_params(bad),
         "generate": lambda: fd.generate(params, [[1]], cfg=bad, max_new_tokens=1),
         "state_nbytes": lambda: fd.state_nbytes(bad, 1),
         "param_spec": lambda: fd.param_spec(bad),
         "param_count_report": lambda: fd.param_count_report(bad)}[call]
    with pytest.raises(TypeError, match=rf"^{call}: cfg must be a functional_dsv41.Config .* got dict$"):
        f()


def test_init_params_refuses_meta():
    """device='meta' drew and quantised every tensor on the CPU to return meta tensors (gigabytes at scale), and with
    draw_on_device it failed inside torch.Generator: param_spec is the tree of shapes."""
    for kw in ({}, {"draw_on_device": True}):
        with pytest.raises(ValueError, match="init_params: device='meta' .* fd.param_spec"):
            fd.init_params(fd.Config.tiny(), device="meta", **kw)


def test_init_params_seed_must_be_an_integer():
    cfg = fd.Config.tiny()
    for bad in (1.5, "1"):                                       # int(1.5) was seed 1 silently
        with pytest.raises(TypeError, match="init_params: seed must be an integer"):
            fd.init_params(cfg, seed=bad)
    with pytest.raises(ValueError, match=r"seed must be in \[-2\*\*63, 2\*\*64\)"):
        fd.init_params(cfg, seed=2**70)
    a, b = fd.init_params(cfg, seed=np.int64(3)), fd.init_params(cfg, seed=3)
    assert fd.tree_diff(a, b, atol=0).ok


def test_unreadable_tokenizer_is_named(tmp_path):
    from functional_dsv41.engram import build_token_map
    with pytest.raises(FileNotFoundError, match=r"no tokenizer file at .*missing\.json"):
        build_token_map(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match=r"a folder: pass its tokenizer\.json"):
        build_token_map(tmp_path)
    ptr = tmp_path / "tokenizer.json"
    ptr.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n")
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot read it as a tokenizer\.json .*git-lfs pointer"):
        build_token_map(ptr)
    ptr.write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read it as a tokenizer\.json \([^)]*\)$"):
        build_token_map(ptr)


def test_generate_argument_types(model):
    cfg, params = model
    with pytest.raises(ValueError, match=r"seed must be in \[-2\*\*63, 2\*\*64\), got"):
        fd.generate(params, [[1]], cfg=cfg, max_new_tokens=1, seed=2**70)
    with pytest.raises(ValueError, match="generate: max_seq_len must be an integer >= 1, got '10'"):
        fd.generate(params, [[1]], cfg=cfg, max_new_tokens=1, max_seq_len="10")
    with pytest.raises(ValueError, match="generate: max_seq_len must be an integer >= 1, got 10.5"):
        fd.generate(params, [[1]], cfg=cfg, max_new_tokens=1, max_seq_len=10.5)
    with pytest.raises(TypeError, match="stream must be a callable"):
        fd.generate(params, [[1]], cfg=cfg, max_new_tokens=1, stream=5)
    out = fd.generate(params, [[1, 2]], cfg=cfg, max_new_tokens=np.int64(2))   # numpy ints, as prompts take
    assert out.stats["new_tokens"] == [2]


def test_tree_diff_atol_and_save_params_arguments(tmp_path, model):
    cfg, params = model
    for bad in ("1e-3", -1.0, float("nan"), True):
        with pytest.raises(TypeError, match="tree_diff: atol must be None or a number >= 0"):
            fd.tree_diff(params, params, atol=bad)
    assert fd.tree_diff(params, params, atol=np.float64(0.0)).ok
    f = tmp_path / "out.safetensors"
    f.write_bytes(b"mine")
    with pytest.raises(ValueError, match=r"out\.safetensors is a file; save_params writes a folder"):
        fd.save_params(params, f, cfg)
    assert f.read_bytes() == b"mine"
    # a folder to make below a file: pathlib's bare NotADirectoryError before
    with pytest.raises(ValueError, match=r"cannot make the folder .*out\.safetensors/a/b: .*out\.safetensors is a "
                                         r"file, not a folder"):
        fd.save_params(params, f / "a" / "b", cfg)
    assert f.read_bytes() == b"mine"
    with pytest.raises(ValueError, match="max_shard_bytes must be a number > 0, got '5e9'"):
        fd.save_params(params, tmp_path / "ck", cfg, max_shard_bytes="5e9")
    assert not (tmp_path / "ck").exists()


def test_token_types_values_and_generate_rows(model):
    cfg, params = model
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"token_types holds -5; the types are -1 \(text\)"):
        fd.forward(params, {"input_ids": ids, "token_types": torch.tensor([[-1, -5, -1]])}, cfg=cfg)
    with pytest.raises(ValueError, match="token_types holds 4"):
        fd.forward(params, {"input_ids": ids, "token_types": torch.tensor([[-1, 4, -1]])}, cfg=cfg)
    with pytest.raises(ValueError, match="token_types must hold one row per prompt .* got int"):
        fd.generate(params, [[1, 2]], cfg=cfg, max_new_tokens=1, token_types=5)


def test_cli_params_that_do_not_fit_the_device(capsys, monkeypatch):
    """--device: a checkpoint too big for the device's memory is one line (exit status 2), not CUDA's traceback;
    the move is stood in for by a tensor method raising what CUDA raises (no GPU here)."""
    import functional_dsv41.state as st
    monkeypatch.setattr(st, "device_problem", lambda d: None)
    import importlib
    gm = importlib.import_module("functional_dsv41.generate")
    monkeypatch.setattr(gm, "device_problem", lambda d: None)

    def to(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    monkeypatch.setattr(torch.Tensor, "to", to)
    rc, err = _cli(capsys, "--ckpt", str(fixture_dir("tiny-bf16")), "--prompt", "hi", "--device", "cuda:0")
    assert rc == 2 and re.fullmatch(r"error: --device cuda:0: the checkpoint's params \([\d.]+ GiB\) do not fit in its "
                                    r"memory\n", err), err
