"""Packing, targets and the resumable data iterator (no model needed)."""
import numpy as np
import pytest
import torch

from functional_dsv41.train import data as D
from functional_dsv41.train import tokenizer as T


def _samples(lengths, start=10):
    return [np.arange(start + 100 * i, start + 100 * i + n, dtype=np.int64) for i, n in enumerate(lengths)]


def test_pack_keeps_every_token_once_and_restarts_positions():
    samples = _samples([5, 12, 3, 20, 7, 1, 9])
    ids, pos = D.pack(samples, row_len=8, pad_id=2, lookahead=4)
    assert ids.shape[1] == 8 and ids.dtype == np.int64
    # reconstruct segments from positions: every segment is a whole sample or a row-length piece of one
    segs = []
    for r in range(len(ids)):
        starts = [i for i in range(8) if pos[r, i] == 0] + [8]
        for a, b in zip(starts, starts[1:]):
            seg = ids[r, a:b]
            assert (pos[r, a:b] == np.arange(b - a)).all()
            if not (seg == 2).all():
                segs.append(tuple(seg))
    pieces = sorted(tuple(s[i:i + 8]) for s in samples for i in range(0, len(s), 8))
    assert sorted(segs) == pieces                       # nothing dropped, nothing duplicated
    assert all(len(p) <= 8 for p in pieces) and any(len(s) > 8 for s in samples)  # long ones were split
    n_tok = sum(len(s) for s in samples)
    assert int((ids != 2).sum()) == n_tok               # the rest is padding
    # padding is a segment of its own, counting 0, 1, ... like a sample (position 0 everywhere passed before)
    ids, pos = D.pack(_samples([3]), row_len=7, pad_id=2)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3]] and (ids[0, 3:] == 2).all()


def test_labels_never_cross_samples_or_padding():
    ids = torch.tensor([[0, 5, 6, 1, 0, 7, 1, 2, 2]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
    lab = D.make_labels(ids, pos, pad_id=2)
    I = D.IGNORE
    assert lab.tolist() == [[5, 6, 1, I, 7, 1, I, I, I]]


def test_iterator_resume_is_exact_and_crosses_epochs():
    samples = _samples([5, 12, 3, 20, 7, 1, 9, 4, 4, 6])
    a = D.PackedData(samples, row_len=8, batch_size=3, pad_id=2, seed=1)
    rows = len(a.epoch_rows(0)[0])
    seq = [a.next_batch() for _ in range(7)]              # 21 rows: crosses into later epochs
    assert a.epoch >= 1 and 21 // rows <= a.epoch
    b = D.PackedData(samples, row_len=8, batch_size=3, pad_id=2, seed=1)
    for _ in range(3):
        b.next_batch()
    c = D.PackedData(samples, row_len=8, batch_size=3, pad_id=2, seed=1)
    c.set_state(b.state())
    for want in seq[3:]:
        got = c.next_batch()
        assert all(torch.equal(want[k], got[k]) for k in want)
    # epochs are shuffled differently but hold the same rows' tokens
    e0, e1 = a.epoch_rows(0)[0], a.epoch_rows(1)[0]
    assert not np.array_equal(e0, e1) and sorted(e0[e0 != 2].tolist()) == sorted(e1[e1 != 2].tolist())


def test_shipped_corpus_and_tokenizer():
    sp = T.special_ids()
    assert (sp["bos"], sp["eos"], sp["pad"]) == (0, 1, 2)
    assert sp["noise"] == sp["vocab_size"] - 1 and sp["image"] == sp["vocab_size"] - 2
    samples = D.shipped_samples(T.CORPUS_TXT, T.TOKENIZER_JSON)
    assert len(samples) > 1000 and all(s[0] == 0 and s[-1] == 1 for s in samples[:50])
    tok = T.load_tokenizer()
    text = "Once upon a time, there was a kind cat named Lily."
    assert tok.decode(tok.encode(text).ids) == text
    d = D.PackedData(list(samples), row_len=128, batch_size=2, pad_id=2)
    st = d.stats()
    assert st["pad_fraction"] < 0.3


def test_cached_corpus_and_tokenizer_follow_a_rewritten_file(tmp_path):
    # a notebook that rewrites its corpus (or retrains its tokenizer) under the same name must not train on
    # the cached old one (run.py records the sha256 of the file as it is now)
    import shutil
    corpus, tok_json = tmp_path / "corpus.txt", tmp_path / "tokenizer.json"
    shutil.copyfile(T.TOKENIZER_JSON, tok_json)
    corpus.write_text("Once upon a time there was a cat.\n" * 3)
    a = D.shipped_samples(str(corpus), str(tok_json))
    corpus.write_text("The dog ran far away into the big green forest today.\n" * 5)
    b = D.shipped_samples(str(corpus), str(tok_json))
    assert len(a) == 3 and len(b) == 5
    n = T.special_ids(str(tok_json))["vocab_size"]
    tok = T.load_tokenizer(str(tok_json))
    tok.add_special_tokens(["<extra>"])
    tok.save(str(tok_json))
    assert T.special_ids(str(tok_json))["vocab_size"] == n + 1


def test_a_corpus_line_is_one_sample_whatever_unicode_separators_it_holds(tmp_path):
    # str.splitlines() cut a line at U+2028 or a form feed into two samples (a boundary no target crosses)
    p = tmp_path / "c.txt"
    p.write_bytes("Once upon a time\u2028there was a cat.\r\nThe dog\x0cran away.\n\n  \nEnd\n".encode("utf-8"))
    samples = D.load_samples(str(p), T.TOKENIZER_JSON)
    tok = T.load_tokenizer()
    assert [tok.decode(s[1:-1].tolist()) for s in samples] == [
        "Once upon a time\u2028there was a cat.", "The dog\x0cran away.", "End"]
    # a line's own trailing blanks are its text (only the line break goes): rstrip() dropped them
    p.write_bytes("Two spaces after  \nand a tab\t\n".encode("utf-8"))
    samples = D.load_samples(str(p), T.TOKENIZER_JSON)
    assert [tok.decode(s[1:-1].tolist()) for s in samples] == ["Two spaces after  ", "and a tab\t"]


def test_a_byte_order_mark_is_not_text_of_the_first_sample(tmp_path):
    """A corpus saved with a UTF-8 BOM (Windows editors) put U+FEFF's bytes at the start of its first sample."""
    p = tmp_path / "c.txt"
    p.write_bytes("\ufeffOnce upon a time\nThe end\n".encode("utf-8"))
    plain = tmp_path / "d.txt"
    plain.write_bytes("Once upon a time\nThe end\n".encode("utf-8"))
    got, want = D.load_samples(str(p), T.TOKENIZER_JSON), D.load_samples(str(plain), T.TOKENIZER_JSON)
    assert [s.tolist() for s in got] == [s.tolist() for s in want]


def _added_tokens(path=T.TOKENIZER_JSON):
    import json
    with open(path, encoding="utf-8") as fh:
        return {t["content"]: t["id"] for t in json.load(fh)["added_tokens"]}


def test_special_token_text_in_the_corpus_is_tokenized_as_text(tmp_path):
    # a line quoting "<｜▁pad▁｜>" or "<｜end▁of▁sentence｜>" was encoded as the control id: padding (no target)
    # or an end of sample in the middle of a sample, and decode() dropped it
    added = _added_tokens()
    assert {T.BOS, T.EOS, T.PAD} <= set(added)
    lines = [f"a cat{text}sat on the mat" for text in added] + [" ".join(added)]
    p = tmp_path / "c.txt"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    samples = D.load_samples(str(p), T.TOKENIZER_JSON)
    tok = T.load_tokenizer()
    control = set(added.values())
    assert len(samples) == len(lines)
    for line, s in zip(lines, samples):
        assert s[0] == 0 and s[-1] == 1                       # the wrapping BOS/EOS are the only control ids
        assert not control & set(s[1:-1].tolist()), (line, s.tolist())
        assert tok.decode(s[1:-1].tolist()) == line           # text, spelled in byte tokens, decodes back
    # packed, a sample quoting the pad token's text has a target at every token but its EOS
    s = samples[list(added).index(T.PAD)]
    ids, pos = D.pack([s], row_len=len(s) + 4, pad_id=2)
    lab = D.make_labels(torch.from_numpy(ids), torch.from_numpy(pos), 2)
    assert int((lab != D.IGNORE).sum()) == len(s) - 1
    # the user-facing tokenizer (prompts, generate) still reads special-token text as the control id
    assert tok.encode(f"hi{T.EOS}").ids[-1] == 1


def test_shipped_corpus_ids_are_the_plain_encoding():
    # the shipped corpus quotes no special token, so corpus encoding changes none of its ids
    with open(T.CORPUS_TXT, encoding="utf-8") as fh:
        text = fh.read()
    assert not [t for t in _added_tokens() if t in text]
    tok = T.load_tokenizer()
    lines = [ln for ln in text.split("\n") if ln.strip()]
    samples = D.load_samples(T.CORPUS_TXT, T.TOKENIZER_JSON)
    assert [s.tolist() for s in samples] == [[0] + e.ids + [1] for e in tok.encode_batch(lines)]


def test_load_tokenizer_returns_a_fresh_object_so_settings_do_not_leak(tmp_path):
    # load_tokenizer() returned one cached Tokenizer: a caller's enable_truncation truncated the corpus samples
    p = tmp_path / "c.txt"
    p.write_text("Once upon a time, there was a kind cat named Lily who loved to play.\n")
    n = len(D.load_samples(str(p), T.TOKENIZER_JSON)[0])
    assert n > 12
    tok = T.load_tokenizer()
    tok.enable_truncation(max_length=8)
    tok.enable_padding(pad_id=2, length=8)
    tok.add_special_tokens(["<extra>"])
    assert len(D.load_samples(str(p), T.TOKENIZER_JSON)[0]) == n
    other = T.load_tokenizer()
    assert other is not tok and other.truncation is None and other.padding is None
    assert other.get_vocab_size() == tok.get_vocab_size() - 1 == T.special_ids()["vocab_size"]
    # a tokenizer file that itself carries truncation/padding settings does not cut corpus samples either
    tok_json = tmp_path / "tok.json"
    tok.save(str(tok_json))
    s = D.load_samples(str(p), str(tok_json))[0]
    assert len(s) == n and 2 not in s.tolist()


def test_pack_and_iterator_refuse_bad_sizes_by_name():
    s = [np.arange(3, dtype=np.int64) + 10]
    for la in (0, -1):
        with pytest.raises(ValueError, match=rf"lookahead must be an integer >= 1, got {la}"):
            D.pack(s, row_len=4, pad_id=2, lookahead=la)
        with pytest.raises(ValueError, match="lookahead"):
            D.PackedData(s, row_len=4, batch_size=1, pad_id=2, lookahead=la)
    with pytest.raises(ValueError, match="pack: no samples"):
        D.pack([], row_len=4, pad_id=2)
    with pytest.raises(ValueError, match="no tokens"):
        D.pack([np.zeros(0, dtype=np.int64)], row_len=4, pad_id=2)
    for bs in (0, -1):
        with pytest.raises(ValueError, match=rf"batch_size must be an integer >= 1, got {bs}"):
            D.PackedData(s, row_len=4, batch_size=bs, pad_id=2)
    with pytest.raises(ValueError, match="row_len must be an integer >= 2, got 1"):   # at construction
        D.PackedData(s, row_len=1, batch_size=1, pad_id=2)
    with pytest.raises(ValueError, match="row_len"):
        D.pack(s, row_len=1, pad_id=2)


def test_set_state_accepts_every_reachable_state_and_refuses_others():
    samples = _samples([5, 12, 3, 20, 7, 1, 9, 4, 4, 6])
    a = D.PackedData(samples, row_len=8, batch_size=3, pad_id=2, seed=1)
    rows = len(a.epoch_rows(0)[0])
    assert rows % 3 != 0                                   # batches end mid-epoch and at other offsets
    states, batches = [a.state()], []
    for _ in range(3 * rows):                              # 9 epochs of rows: every offset is reached
        batches.append(a.next_batch())
        states.append(a.state())
    assert {0} < {st["offset"] for st in states} and max(st["epoch"] for st in states) >= 2
    for i, st in enumerate(states[:-1]):
        b = D.PackedData(samples, row_len=8, batch_size=3, pad_id=2, seed=1)
        b.set_state(st)
        got = b.next_batch()
        assert all(torch.equal(got[k], batches[i][k]) for k in got) and b.state() == states[i + 1]
    b = D.PackedData(samples, row_len=8, batch_size=3, pad_id=2, seed=1)
    b.set_state({"epoch": 1, "offset": 2})
    bad = [({"epoch": -1, "offset": 0}, "epoch must be >= 0, got -1"),
           ({"epoch": 0, "offset": -1}, rf"offset -1 out of range for epoch 0, which has {rows} rows"),
           ({"epoch": 0, "offset": rows}, rf"offset {rows} out of range"),
           ({"epoch": 3, "offset": 999}, rf"offset 999 out of range for epoch 3"),
           ({"epoch": 0}, "'offset' missing"),
           ({"epoch": 0, "offset": 1.5}, "offset must be an integer, got 1.5"),
           ({"epoch": True, "offset": 0}, "epoch must be an integer")]
    for st, msg in bad:
        with pytest.raises(ValueError, match=msg):
            b.set_state(st)
        assert b.state() == {"epoch": 1, "offset": 2}      # a refused state changes nothing
    b.set_state({"epoch": np.int64(2), "offset": np.int64(rows - 1)})
    assert b.state() == {"epoch": 2, "offset": rows - 1}


# ----------------------------------------------------------------------------- train/tokenizer.py: writing, decoding
def test_train_tokenizer_writes_atomically(tmp_path, monkeypatch):
    """tokenizer.json was written in place (tok.save): a write that failed part way (a full disk, RLIMIT_FSIZE) left
    a torn, unloadable file where a good one stood (the default --out is the shipped data/tokenizer.json). Now the
    write goes through config.write_atomic: the old file stays byte-identical and no temporary file remains."""
    import errno

    from functional_dsv41 import config as C
    out = tmp_path / "tokenizer.json"
    old = open(T.TOKENIZER_JSON, "rb").read()
    out.write_bytes(old)
    real_open = open

    class Torn:                                  # writes half of the text, then the disk is full
        def __init__(self, *a, **kw):
            self.fh = real_open(*a, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, text):
            self.fh.write(text[:len(text) // 2])
            self.fh.flush()
            raise OSError(errno.EFBIG, "File too large")

        def __getattr__(self, name):
            return getattr(self.fh, name)

    monkeypatch.setattr(C, "open", Torn, raising=False)
    with pytest.raises(OSError, match="File too large"):
        T.train_tokenizer(vocab_size=300, out=str(out))          # different content from the old file
    assert out.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]
    monkeypatch.undo()
    # a good write: the bytes tok.save wrote, and a file load_tokenizer reads
    tok = T.train_tokenizer(vocab_size=300, out=str(out))
    saved = tmp_path / "saved.json"
    tok.save(str(saved))
    assert out.read_bytes() == saved.read_bytes()
    assert T.load_tokenizer(str(out)).get_vocab_size() == 300


def test_train_tokenizer_survives_a_real_file_size_limit(tmp_path):
    """The review's repro: under RLIMIT_FSIZE the old code left a truncated tokenizer.json."""
    resource = pytest.importorskip("resource")
    import subprocess
    import sys
    out = tmp_path / "tokenizer.json"
    old = open(T.TOKENIZER_JSON, "rb").read()
    out.write_bytes(old)
    code = ("import resource, sys\n"
            "from functional_dsv41.train import tokenizer as T\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
            "T.train_tokenizer(vocab_size=300, out=sys.argv[1])\n")
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "File too large" in r.stderr, r.stderr
    assert out.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]


def test_train_tokenizer_refuses_bad_arguments_by_name(tmp_path, capsys):
    """--vocab 5 was 'OverflowError: can't convert negative int to unsigned', --corpus /nonexistent 'Exception: No
    such file or directory (os error 2)' without the path; now argparse errors naming them, before any training
    or writing."""
    out = tmp_path / "tokenizer.json"
    out.write_bytes(b"old")

    def cli_error(*argv):
        with pytest.raises(SystemExit) as e:
            T.main([*argv, "--out", str(out)])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert out.read_bytes() == b"old", err                   # nothing written
        return err

    assert cli_error("--vocab", "5").endswith("error: --vocab 5 is too small: the tokenizer needs at least "
                                              "265 ids (3 specials, 256 byte tokens, 6 chat/image/DSpark specials)")
    assert "--vocab 264 is too small" in cli_error("--vocab", "264")
    assert cli_error("--corpus", "/nonexistent").endswith("error: --corpus /nonexistent: no such file")
    assert cli_error("--corpus", str(tmp_path)).endswith(f"error: --corpus {tmp_path}: a directory, not a text file")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    err = cli_error("--corpus", str(bad))
    assert f"corpus {bad}: cannot train on it (stream did not contain valid UTF-8)" in err, err
    err = cli_error("--corpus", "/nonexistent", "--vocab", "5")            # every problem at once
    assert "--vocab 5 is too small" in err and "--corpus /nonexistent: no such file" in err
    with pytest.raises(SystemExit):
        T.main(["--out", str(tmp_path / "no" / "such" / "dir.json")])
    assert f"its folder {tmp_path / 'no' / 'such'} does not exist" in capsys.readouterr().err
    # the function refuses the same way (ValueError), and the minimum itself trains
    least = T.min_vocab_size()
    assert least == 3 + 256 + len(T.TOP_SPECIALS) == 265
    with pytest.raises(ValueError, match=r"train_tokenizer: vocab_size 5 is too small: .* at least 265 ids"):
        T.train_tokenizer(vocab_size=5, out=None)
    with pytest.raises(ValueError, match="train_tokenizer: corpus /nonexistent: no such file"):
        T.train_tokenizer(corpus="/nonexistent", out=None)
    assert T.train_tokenizer(vocab_size=least, out=None).get_vocab_size() == least


def test_checked_decode_names_ids_the_tokenizer_cannot_decode():
    """tok.decode([5, 10**6, 7]) dropped 10**6 from the text silently and tok.decode([-1]) raised OverflowError;
    T.decode raises a ValueError naming the ids, and decodes valid ids exactly as tok.decode does."""
    tok = T.load_tokenizer()
    n = tok.get_vocab_size()
    assert tok.decode([5, 10**6, 7]) == tok.decode([5, 7])            # the library's silent drop, documented
    with pytest.raises(ValueError, match=rf"decode: token id\(s\) 1000000 not in the tokenizer's vocabulary "
                                         rf"\(integers in \[0, {n}\) with a token\)"):
        T.decode(tok, [5, 10**6, 7])
    with pytest.raises(ValueError, match=r"token id\(s\) -1 not"):
        T.decode(tok, [-1])
    with pytest.raises(ValueError, match=rf"token id\(s\) {n}, True, 2.0 not"):
        T.decode(tok, [n, 3, True, 2.0])
    with pytest.raises(ValueError, match=rf"{n}, {n + 1}, .*\.\.\. \(20 in all\)"):
        T.decode(tok, list(range(n, n + 20)))
    assert T.undecodable_ids(tok, [0, n - 1, n, -3]) == [n, -3]
    ids = tok.encode("Once upon a time, there was a café. <｜User｜>").ids
    assert T.decode(tok, ids) == tok.decode(ids)
    assert T.decode(tok, np.array(ids)) == T.decode(tok, torch.tensor(ids)) == tok.decode(ids)
    assert T.decode(tok, ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    assert T.decode(tok, []) == ""
