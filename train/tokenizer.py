"""The shipped byte-level BPE tokenizer: training it on data/corpus.txt, loading it, special ids.

Layout follows the release's tokenizer (and the fixtures' tiny one): ``<｜begin▁of▁sentence｜>`` = 0,
``<｜end▁of▁sentence｜>`` = 1, ``<｜▁pad▁｜>`` = 2, then the learned BPE vocabulary, then the chat /
image / DSpark specials at the top: ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>``,
``<｜deepseek_image｜>`` (= vocab-2, the config's ``image_token_id``) and ``<｜place▁holder▁no▁799｜>``
(= vocab-1, the config's ``dspark_noise_token_id``, like the release's id 128799).

    python train/tokenizer.py [--vocab 768] [--corpus data/corpus.txt] [--out data/tokenizer.json]

Training is deterministic for a fixed corpus and vocab size (the ``tokenizers`` BPE trainer breaks
ties by byte order), so the committed ``data/tokenizer.json`` can be regenerated. ``--vocab`` is at least
``min_vocab_size()`` (265: 3 specials, 256 byte tokens, 6 top specials); bad arguments are refused before
training, and the file is replaced atomically (a failed write leaves the old one). ``decode(tok, ids)`` is
``tok.decode`` that refuses ids the tokenizer has no token for (``tok.decode`` drops them silently).
"""
from __future__ import annotations

import argparse
import operator
import os
from functools import lru_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO, "data")
TOKENIZER_JSON = os.path.join(DATA_DIR, "tokenizer.json")
CORPUS_TXT = os.path.join(DATA_DIR, "corpus.txt")

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
LOW_SPECIALS = (BOS, EOS, PAD)                 # ids 0, 1, 2
TOP_SPECIALS = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                "<｜deepseek_image｜>", "<｜place▁holder▁no▁799｜>")
IMAGE_TOKEN, NOISE_TOKEN = TOP_SPECIALS[-2], TOP_SPECIALS[-1]


def min_vocab_size() -> int:
    """The smallest ``vocab_size`` train_tokenizer can build: the low specials, the byte-level alphabet (every
    byte one token, the trainer's ``initial_alphabet``) and the top specials, with no merge learned (265)."""
    from tokenizers import pre_tokenizers
    return len(LOW_SPECIALS) + len(pre_tokenizers.ByteLevel.alphabet()) + len(TOP_SPECIALS)


def check_train_args(corpus, vocab_size, out, names=("corpus", "vocab_size", "out")) -> list[str]:
    """Why ``train_tokenizer(corpus, vocab_size, out)`` cannot run, one line per problem (empty: it can), each
    naming the argument (as ``names`` spells them: the CLI passes its flags) and its value; checked before any
    training or writing."""
    n_corpus, n_vocab, n_out = names
    why = []
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        why.append(f"{n_vocab} must be an integer, got {vocab_size!r}")
    elif vocab_size < (least := min_vocab_size()):
        why.append(f"{n_vocab} {vocab_size} is too small: the tokenizer needs at least {least} ids "
                   f"({len(LOW_SPECIALS)} specials, 256 byte tokens, {len(TOP_SPECIALS)} chat/image/DSpark specials)")
    if not isinstance(corpus, (str, os.PathLike)):
        why.append(f"{n_corpus} must be a file path, got {corpus!r}")
    elif not os.path.exists(corpus):
        why.append(f"{n_corpus} {os.fspath(corpus)}: no such file")
    elif os.path.isdir(corpus):
        why.append(f"{n_corpus} {os.fspath(corpus)}: a directory, not a text file")
    elif not os.access(corpus, os.R_OK):
        why.append(f"{n_corpus} {os.fspath(corpus)}: not readable")
    if out:
        if not isinstance(out, (str, os.PathLike)):
            why.append(f"{n_out} must be a file path, got {out!r}")
        elif os.path.isdir(out):
            why.append(f"{n_out} {os.fspath(out)}: a directory; give the path of the tokenizer.json file")
        elif not os.path.isdir(folder := os.path.dirname(os.path.abspath(out))):
            why.append(f"{n_out} {os.fspath(out)}: its folder {folder} does not exist")
    return why


def train_tokenizer(corpus: str = CORPUS_TXT, vocab_size: int = 768, out: str | None = TOKENIZER_JSON):
    """Train the byte-level BPE on ``corpus`` (one sample per line) and save it to ``out``.

    Bad arguments (``vocab_size`` below ``min_vocab_size()``, a missing corpus...) raise ValueError naming
    them, before training. ``out`` is written atomically (``config.write_atomic``: a temporary file, then
    ``os.replace``), so a failed write leaves the file that stood there, never a torn one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from functional_dsv41.config import write_atomic

    why = check_train_args(corpus, vocab_size, out)
    if why:
        raise ValueError("train_tokenizer: " + "; ".join(why))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    n_bpe = vocab_size - len(TOP_SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, special_tokens=list(LOW_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    try:
        tok.train([os.fspath(corpus)], trainer)
    except Exception as e:                     # the tokenizers library raises a bare Exception without the path
        raise ValueError(f"train_tokenizer: corpus {os.fspath(corpus)}: cannot train on it ({e})") from None
    if tok.get_vocab_size() != n_bpe:
        raise RuntimeError(f"BPE learned {tok.get_vocab_size()} ids, wanted {n_bpe}: corpus too small for "
                           f"vocab_size={vocab_size}")
    tok.add_special_tokens(list(TOP_SPECIALS))
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1 and tok.token_to_id(PAD) == 2
    assert tok.token_to_id(NOISE_TOKEN) == vocab_size - 1 and tok.get_vocab_size() == vocab_size
    if out:
        write_atomic(out, tok.to_str(pretty=True))     # the bytes tok.save(out) writes
    return tok


def file_key(path: str) -> tuple:
    """``(path, size, mtime_ns, inode)`` of a file: a cache key that changes when the file is rewritten, so a
    notebook that retrains the tokenizer or rewrites a corpus under the same name does not get the old one."""
    st = os.stat(path)
    return (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)


def load_tokenizer(path: str = TOKENIZER_JSON):
    """A fresh ``tokenizers.Tokenizer`` from ``path`` (the file's text is cached while it is unchanged).

    Every call returns a new object: a ``Tokenizer`` is mutable (``enable_truncation``, ``enable_padding``,
    ``add_special_tokens``...), and a shared cached one let one caller's settings reach every other caller,
    the corpus encoding included. Special-token text in the input (``<｜end▁of▁sentence｜>``...) is encoded
    as the special id (the ``tokenizers`` default, what prompts want); ``corpus_tokenizer`` does not."""
    from tokenizers import Tokenizer
    return Tokenizer.from_str(_tokenizer_text(_key(path)))


def undecodable_ids(tok, ids) -> list:
    """The entries of ``ids`` that ``tok`` has no token for, in order: negatives, ids >= its vocabulary size,
    ids in a hole of its vocabulary, and non-integers (bools included). ``tok.decode`` drops such ids from the
    text silently (a negative one raises OverflowError)."""
    n = tok.get_vocab_size()                   # added tokens included
    bad = []
    for t in ids:
        try:
            i = None if isinstance(t, bool) else operator.index(t)
        except TypeError:
            i = None
        if i is None or not 0 <= i < n or tok.id_to_token(i) is None:
            bad.append(t)
    return bad


def decode(tok, ids, skip_special_tokens: bool = True) -> str:
    """``tok.decode(ids, skip_special_tokens)`` that refuses ids ``tok`` cannot decode instead of dropping them
    from the text: ValueError naming the bad ids (see ``undecodable_ids``). ``ids``: a sequence of integers
    (Python, numpy, 0-d torch) or a 1-D tensor / array."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = list(ids)
    bad = undecodable_ids(tok, ids)
    if bad:
        shown = ", ".join(repr(b) for b in bad[:8]) + (f", ... ({len(bad)} in all)" if len(bad) > 8 else "")
        raise ValueError(f"decode: token id(s) {shown} not in the tokenizer's vocabulary (integers in "
                         f"[0, {tok.get_vocab_size()}) with a token); decoding would drop them from the text")
    return tok.decode([operator.index(t) for t in ids], skip_special_tokens=skip_special_tokens)


def corpus_tokenizer(path: str = TOKENIZER_JSON):
    """A fresh tokenizer for corpus text: special-token text in a line is tokenized as text (byte tokens that
    decode back to it), never as a control id; no truncation or padding; the caller adds BOS/EOS itself and
    encodes with ``add_special_tokens=False`` (no post-processor template)."""
    tok = load_tokenizer(path)
    tok.encode_special_tokens = True
    tok.no_truncation()
    tok.no_padding()
    return tok


def _key(path: str) -> tuple:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found; run `python train/tokenizer.py` to train it")
    return file_key(path)


@lru_cache(maxsize=4)
def _tokenizer_text(key: tuple) -> str:
    with open(key[0], encoding="utf-8") as fh:
        return fh.read()


def special_ids(path: str = TOKENIZER_JSON) -> dict[str, int]:
    """bos/eos/pad/image/noise ids and the vocabulary size of the tokenizer at ``path``."""
    tok = load_tokenizer(path)
    ids = dict(bos=tok.token_to_id(BOS), eos=tok.token_to_id(EOS), pad=tok.token_to_id(PAD),
               image=tok.token_to_id(IMAGE_TOKEN), noise=tok.token_to_id(NOISE_TOKEN),
               vocab_size=tok.get_vocab_size())
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(f"{path}: special token(s) {missing} not in the vocabulary")
    return ids


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train the shipped byte-level BPE tokenizer.")
    ap.add_argument("--corpus", default=CORPUS_TXT)
    ap.add_argument("--vocab", type=int, default=768, help=f"vocabulary size (at least {min_vocab_size()})")
    ap.add_argument("--out", default=TOKENIZER_JSON)
    a = ap.parse_args(argv)
    why = check_train_args(a.corpus, a.vocab, a.out, names=("--corpus", "--vocab", "--out"))
    if why:                                    # before training, and before anything is written
        ap.error("; ".join(why))
    try:
        tok = train_tokenizer(a.corpus, a.vocab, a.out)
    except (ValueError, RuntimeError) as e:    # a corpus the trainer cannot read or too small for --vocab
        ap.error(str(e))
    with open(a.corpus, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    n = sum(len(e.ids) for e in tok.encode_batch(lines))
    print(f"vocab {tok.get_vocab_size()}; {len(lines)} samples, {n} tokens "
          f"({n / max(len(lines), 1):.1f}/sample) -> {a.out}")


if __name__ == "__main__":
    main()
