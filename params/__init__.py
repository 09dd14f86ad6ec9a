"""The parameter pytree: names and shapes (``spec``), random init (``init``), released checkpoints (read:
``checkpoint``, write: ``save``), and training's own checkpoints (``train_state``: params, optimizer state, step,
data position and RNG with orbax-checkpoint, which it imports only when used).

    spec   = param_spec(cfg)                  # meta tensors, no allocation
    params = init_params(cfg, seed=0)         # storage dtypes (fp8/fp4 + e8m0 scales)
    master = init_params(cfg, seed=0, master=True)   # float master weights for QAT training
    params = load_params("ckpt_dir", cfg)     # released *.safetensors (single or sharded)
    save_params(params, "out_dir", cfg)       # back to the released layout, atomically
    print(param_count_report(cfg))            # logical parameter counts by group
    ck = TrainCheckpointer("run/ckpt")        # ck.save(step, params=..., opt_state=...); ck.restore()
"""
from .spec import Entry, param_spec, spec_entries
from .init import init_params
from .count import ParamCountReport, param_count_report
from .checkpoint import CheckpointError, load_params
from .save import save_params
from .train_state import TrainCheckpointer, to_storage

__all__ = ["Entry", "param_spec", "spec_entries", "init_params", "param_count_report", "ParamCountReport",
           "load_params", "save_params", "CheckpointError", "TrainCheckpointer", "to_storage"]
