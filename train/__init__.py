"""Training for functional_dsv41 (importable as ``functional_dsv41.train``).

- ``data``: the shipped corpus, packed rows with per-sample positions, a resumable iterator
- ``tokenizer``: the shipped byte-level BPE (train / load)
- ``loss``: named loss parts (next-token CE, DSpark draft, indexer KL)
- ``optim``: functional AdamW over flat param dicts, clipping, warmup + cosine schedule
- ``step``: the ``torch.func.grad_and_value`` training step, trainable/frozen split, remat
- ``checkpoint``: orbax train-state checkpoints (lossless torch <-> numpy)
- ``run``: the scripted loop (``python train/run.py --config tiny --out runs/tiny``)

Submodules are imported on use; ``import functional_dsv41.train`` is cheap.
"""
