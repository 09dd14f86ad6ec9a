"""functional_dsv41: DeepSeek-V4.1-Flash as pure functions over parameter pytrees.

    import functional_dsv41 as fd
    cfg    = fd.Config.tiny()
    params = fd.init_params(cfg, seed=0)
    out    = fd.forward(params, {"input_ids": ids}, cfg=cfg)

The public names are imported lazily so that ``import functional_dsv41`` stays cheap.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

from .config import Config, ConfigError

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "__version__"]  # + the lazy names below (see __dir__)

# In an installed package, kernels/, params/ and train/ are subpackages (setuptools package-dir mapping).
# From a bare checkout (no install), map them here so `python train/run.py` works as well.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("kernels", "params", "train"):
    _full = f"{__name__}.{_sub}"
    if _full in sys.modules:
        continue
    try:
        _found = importlib.util.find_spec(_full) is not None
    except ImportError:
        _found = False
    _init = os.path.join(_ROOT, _sub, "__init__.py")
    if not _found and os.path.exists(_init):
        _spec = importlib.util.spec_from_file_location(_full, _init,
                                                       submodule_search_locations=[os.path.dirname(_init)])
        _mod = importlib.util.module_from_spec(_spec)
        sys.modules[_full] = _mod
        _spec.loader.exec_module(_mod)

_LAZY = {
    # params
    "param_spec": "functional_dsv41.params",
    "init_params": "functional_dsv41.params",
    "load_params": "functional_dsv41.params",
    "save_params": "functional_dsv41.params",
    "param_count_report": "functional_dsv41.params",
    # pytree tools
    "tree_diff": "functional_dsv41.pytree",
    "flatten_with_paths": "functional_dsv41.pytree",
    "unflatten_from_paths": "functional_dsv41.pytree",
    "tree_map_with_path": "functional_dsv41.pytree",
    # model
    "forward": "functional_dsv41.model",
    "ForwardOutput": "functional_dsv41.model",
    "init_state": "functional_dsv41.state",
    "clone_state": "functional_dsv41.state",
    "state_nbytes": "functional_dsv41.state",
    "DecodeState": "functional_dsv41.state",
    "generate": "functional_dsv41.generate",
    "dspark_forward": "functional_dsv41.dspark",
    "dspark_draft": "functional_dsv41.dspark",
    "dspark_prefill": "functional_dsv41.dspark",
    "encode_messages": "functional_dsv41.encoding", "parse_assistant": "functional_dsv41.encoding",  # chat template
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


class _Package(types.ModuleType):
    """The package's module type: keeps ``fd.generate`` the function.

    ``functional_dsv41/generate.py`` (the module that holds it and the documented ``python -m
    functional_dsv41.generate`` CLI) has the function's name, and the import system binds every
    loaded submodule as an attribute of its package. Whatever the import order, that binding would
    replace the function by the module; it is dropped here, so ``fd.generate`` resolves through the
    lazy table above. The module itself stays reachable as ``sys.modules["functional_dsv41.generate"]``
    and through ``from functional_dsv41.generate import ...``.
    """

    def __setattr__(self, name, value):
        if name in _LAZY and isinstance(value, types.ModuleType):    # every lazy public name is a
            return                                                   # function or class, never a module
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
