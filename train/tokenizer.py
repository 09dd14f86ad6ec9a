"""The shipped byte-level BPE tokenizer: training it on data/corpus.txt, loading it, special ids.

Layout follows the release's tokenizer (and the fixtures' tiny one): ``<｜begin▁of▁sentence｜>`` = 0,
``<｜end▁of▁sentence｜>`` = 1, ``<｜▁pad▁｜>`` = 2, then the learned BPE vocabulary, then the chat /
image / DSpark specials at the top: ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>``,
``<｜deepseek_image｜>`` (= vocab-2, the config's ``image_token_id``) and ``<｜place▁holder▁no▁799｜>``
(= vocab-1, the config's ``dspark_noise_token_id``, like the release's id 128799).

    python train/tokenizer.py [--vocab 768] [--corpus data/corpus.txt] [--out data/tokenizer.json]

Training is deterministic for a fixed corpus and vocab size (the ``tokenizers`` BPE trainer breaks
ties by byte order), so the committed ``data/tokenizer.json`` can be regenerated.
"""
from __future__ import annotations

import argparse
import os
from functools import lru_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO, "data")
TOKENIZER_JSON = os.path.join(DATA_DIR, "tokenizer.json")
CORPUS_TXT = os.path.join(DATA_DIR, "corpus.txt")

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
TOP_SPECIALS = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                "<｜deepseek_image｜>", "<｜place▁holder▁no▁799｜>")
IMAGE_TOKEN, NOISE_TOKEN = TOP_SPECIALS[-2], TOP_SPECIALS[-1]


def train_tokenizer(corpus: str = CORPUS_TXT, vocab_size: int = 768, out: str | None = TOKENIZER_JSON):
    """Train the byte-level BPE on ``corpus`` (one sample per line) and save it to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    n_bpe = vocab_size - len(TOP_SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([corpus], trainer)
    if tok.get_vocab_size() != n_bpe:
        raise RuntimeError(f"BPE learned {tok.get_vocab_size()} ids, wanted {n_bpe}: corpus too small for "
                           f"vocab_size={vocab_size}")
    tok.add_special_tokens(list(TOP_SPECIALS))
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1 and tok.token_to_id(PAD) == 2
    assert tok.token_to_id(NOISE_TOKEN) == vocab_size - 1 and tok.get_vocab_size() == vocab_size
    if out:
        tok.save(out)
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
    ap.add_argument("--vocab", type=int, default=768)
    ap.add_argument("--out", default=TOKENIZER_JSON)
    a = ap.parse_args(argv)
    tok = train_tokenizer(a.corpus, a.vocab, a.out)
    with open(a.corpus, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    n = sum(len(e.ids) for e in tok.encode_batch(lines))
    print(f"vocab {tok.get_vocab_size()}; {len(lines)} samples, {n} tokens "
          f"({n / max(len(lines), 1):.1f}/sample) -> {a.out}")


if __name__ == "__main__":
    main()
