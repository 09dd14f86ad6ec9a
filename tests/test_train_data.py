"""Packing, targets and the resumable data iterator (no model needed)."""
import numpy as np
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
