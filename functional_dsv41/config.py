"""Model configuration: one frozen dataclass whose fields are the inference ``config.json`` keys.

SPEC §0 lists every key and its release value; §0.1 derives the per-layer roles that the methods
below compute (attention mode, which layer's compressed KV / index keys / top-k a layer reads, MoE
size of a layer, RoPE base and YaRN of a layer).

The config is static: pass it by keyword (``cfg=cfg``), never inside params. Every field defaults to
the released value, so ``Config()`` is DeepSeek-V4.1-Flash; ``Config.flash()`` says so explicitly and
``Config.tiny()`` is the small model of the test fixtures. Reading a file is strict: ``from_json`` /
``from_dict`` need every key except the five of :data:`OPTIONAL_KEYS` (a key left out of a tiny model's
config.json would otherwise take the release's value and silently compute another model).

Layer ids: backbone blocks are ``0 .. n_layers-1``; DSpark draft stages are ``n_layers .. n_layers +
n_mtp_layers - 1`` (checkpoint namespace ``mtp.{s}``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

AttnMode = Literal["window", "full", "reindex", "reuse"]


class ConfigError(ValueError):
    """A config that would make the model fail or silently compute something else."""


# SPEC §0: the only ModelArgs keys the release's inference config.json leaves out (the reference's defaults
# apply: gate_temp 1.0, norm_topk_prob True, temperature set by generate.py, batch / sequence limits). Every
# other field, the vision_* ones included (the release ships its vision tower; a text-only config writes
# vision_n_layers = 0 with the other vision keys still present, as the fixtures and to_dict do), must be in
# a config.json that from_json / from_dict reads.
OPTIONAL_KEYS = frozenset({"gate_temp", "norm_topk_prob", "temperature", "max_batch_size", "max_seq_len"})

# keys that only the Hugging Face top-level config.json has (SPEC §0); seen in a file, it is the wrong one
_HF_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "moe_intermediate_size", "num_experts_per_tok", "architectures", "model_type", "rope_scaling",
            "quantization_config", "vision_config")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json ``object_pairs_hook``: a key written twice (json keeps the last silently) is refused."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(f"duplicate key {k!r} (json would keep the last of its values silently)")
        out[k] = v
    return out


def short_repr(v: Any, width: int = 120) -> str:
    """repr for error messages, at most ``width`` characters ("..." where cut); a 400-digit JSON integer is named
    by its length, not printed. Also the state's and a resume's config-difference messages."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10 ** 30:
        return f"an integer of {len(str(abs(v)))} digits"
    r = repr(v)
    return r if len(r) <= width else r[:width - 3] + "..."


def _release_ratios() -> tuple[int, ...]:
    return (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)


def require_config(cfg, who: str) -> None:
    """A TypeError naming the caller when ``cfg`` is not a Config (a path or a dict failed later with an
    AttributeError such as "'str' object has no attribute 'max_seq_len'")."""
    if not isinstance(cfg, Config):
        raise TypeError(f"{who}: cfg must be a functional_dsv41.Config (fd.Config.from_json(path), "
                        f"fd.Config.from_dict(d), fd.Config.tiny()), got {type(cfg).__name__}")


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: a crash leaves the old file or
    the new one, never a torn one (``Config.to_json`` and train/run.py's record files). A target that is a folder, or
    whose folder is missing or a file, is refused by its own name (OSError named the temporary file)."""
    path = os.fspath(path)
    parent = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise IsADirectoryError(f"cannot write {path}: it is a folder, not a file")
    if not os.path.isdir(parent):
        if os.path.exists(parent):
            raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a folder")
        raise FileNotFoundError(f"cannot write {path}: {parent} does not exist")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@dataclass(frozen=True)
class Config:
    # -- runtime keys of the reference's ModelArgs (not in the release config.json) --
    max_batch_size: int = 4
    max_seq_len: int = 65536
    temperature: float = 1.0
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    # -- storage --
    dtype: Optional[str] = "fp8"          # dense Linear storage: "fp8" (e4m3, 32x32 e8m0 scales) or "bf16"
    expert_dtype: Optional[str] = "fp4"   # routed experts: "fp4" (e2m1, 1x32 e8m0 scales) or None = like dtype
    # -- backbone --
    vocab_size: int = 129280
    dim: int = 5120
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    norm_eps: float = 1e-20
    # -- MoE --
    n_routed_experts: int = 384
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    moe_inter_dim: int = 2304
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # -- compressed attention, indexer --
    compress_ratios: tuple[int, ...] = field(default_factory=_release_ratios)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    original_seq_len: int = 65536
    rope_factor: float = 16
    beta_fast: float = 32
    beta_slow: float = 1
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # -- manifold-constrained hyper-connections --
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # -- Engram --
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # -- vision --
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: Optional[float] = None
    image_token_id: int = 129264
    # -- DSpark draft stages --
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3

    # ------------------------------------------------------------------ construction
    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):  # lists from JSON become tuples so the config stays hashable
                object.__setattr__(self, f.name, tuple(v))
        from .config_checks import validate     # (it imports this module)
        validate(self)

    @classmethod
    def flash(cls, **overrides) -> "Config":
        """The released DeepSeek-V4.1-Flash values (SPEC §0)."""
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides) -> "Config":
        """The 10-layer model of the test fixtures (``fixtures/tiny-bf16/config.json``), bf16 storage."""
        base = dict(
            max_batch_size=4, max_seq_len=64, temperature=0.0, dtype="bf16", expert_dtype=None,
            vocab_size=512, dim=128, moe_inter_dim=32, n_layers=10, n_mtp_layers=2, n_heads=4,
            n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, swiglu_limit=2.0,
            q_lora_rank=64, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32, window_size=8,
            compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0), kv_source_layers=(2, 5),
            index_source_layers=(2, 5, 7), index_n_heads=8, index_head_dim=32, index_topk=4,
            candidate_source_layer=5, candidate_topk_blocks=3, candidate_block_size=2,
            engram_layer_ids=(1, 4), engram_num_embeddings=(2514, 2712), engram_vocab_size=400,
            engram_n_heads=2, engram_head_dim=32, engram_compressed_vocab_size=334,
            vision_n_layers=0, vision_dim=64, vision_n_heads=4, vision_inter_dim=96,
            vision_max_n_token=16, vision_min_pixels=6000, image_token_id=510,
            dspark_block_size=3, dspark_noise_token_id=511, dspark_target_layer_ids=(7, 8, 9),
            dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_n_activated_experts=2,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Config":
        """A Config from the keys of an inference ``config.json`` (a dict as ``json.load`` gives it).

        Every field must be present except the five of :data:`OPTIONAL_KEYS` (SPEC §0: absent from the
        release's config.json, the reference's defaults apply). Raises TypeError for something that is not a
        dict of string keys (a path: use :meth:`from_json`), ConfigError naming the unknown, missing or
        invalid key(s), for the Hugging Face top-level config.json (other key names), and for Engram tables
        (``engram_num_embeddings``) of other sizes than the hash layout's (SPEC §6.2: forward refused them, after
        init_params / load_params had made them). Only here: code builds configs whose tables it fills itself
        (train/settings.py's ``tiny_model`` probes the layout with 1-row tables).
        """
        if isinstance(d, (str, bytes, os.PathLike)):
            raise TypeError(f"Config.from_dict: got a path {d!r}, not a dict; read a config.json file with "
                            f"Config.from_json(path)")
        if not isinstance(d, Mapping):
            raise TypeError(f"Config.from_dict: expected a dict of config.json keys, got {type(d).__name__} "
                            f"(a config.json file: Config.from_json(path))")
        not_str = [k for k in d if not isinstance(k, str)]
        if not_str:
            raise TypeError(f"Config.from_dict: keys must be config.json key names (strings), got "
                            f"{', '.join(short_repr(k) for k in not_str[:5])}")
        hf = [k for k in _HF_KEYS if k in d]
        if hf:
            raise ConfigError(f"this is the Hugging Face config.json (it has {', '.join(hf[:4])}); Config reads "
                              f"the inference config.json (the release's inference/config.json: keys dim, "
                              f"n_layers, n_heads, ...)")
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
        missing = [k for k in fields if k not in d and k not in OPTIONAL_KEYS]
        if missing:
            raise ConfigError(f"missing config key(s): {', '.join(missing)} (only "
                              f"{', '.join(sorted(OPTIONAL_KEYS))} may be left out, SPEC §0; the others would "
                              f"silently take the release's values)")
        cfg = cls(**d)
        from .config_checks import engram_layout_error
        if (why := engram_layout_error(cfg)) is not None:
            raise ConfigError(f"engram_num_embeddings: {why}")
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Config":
        """Read an inference-style ``config.json`` (the reference's ``ModelArgs`` keys; :meth:`from_dict` says
        which may be absent). FileNotFoundError / IsADirectoryError name the path (a checkpoint folder: pass
        ``folder/config.json``); ConfigError for a file that is not a JSON object, has a key twice, or is not
        a valid config."""
        if isinstance(path, Mapping):
            raise TypeError("Config.from_json: got a dict, not a path; use Config.from_dict(d)")
        if os.path.isdir(path):
            raise IsADirectoryError(f"Config.from_json: {path} is a folder; pass the config.json inside it "
                                    f"({os.path.join(path, 'config.json')})")
        try:
            with open(path, encoding="utf-8") as fh:
                d = json.load(fh, object_pairs_hook=_unique_keys)
        except FileNotFoundError:
            raise FileNotFoundError(f"Config.from_json: {path} does not exist") from None
        except ConfigError as e:                                   # a duplicate key
            raise ConfigError(f"{path}: {e}") from None
        except ValueError as e:   # not JSON, not text (a .safetensors passed by mistake), a > 4300-digit integer
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v, tuple) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    def to_json(self, path: str | os.PathLike) -> None:
        """Write ``to_dict()`` as JSON through :func:`write_atomic`: a write that fails (disk full) leaves the
        previous file whole, never a torn config.json beside a good checkpoint."""
        write_atomic(path, json.dumps(self.to_dict(), indent=4) + "\n")

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def _last_at_or_before(layers: tuple[int, ...], L: int) -> Optional[int]:
        c = [s for s in layers if s <= L]
        return c[-1] if c else None

    # ------------------------------------------------------------------ derived per-layer facts
    @property
    def n_total_layers(self) -> int:
        """Backbone blocks plus DSpark stages."""
        return self.n_layers + self.n_mtp_layers

    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.dim

    @property
    def n_hc_mix(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def is_dspark(self, L: int) -> bool:
        return L >= self.n_layers

    def param_prefix(self, L: int) -> str:
        """Checkpoint namespace of layer id L: ``layers.L`` or ``mtp.S``."""
        return f"mtp.{L - self.n_layers}" if self.is_dspark(L) else f"layers.{L}"

    def compress_ratio(self, L: int) -> int:
        return self.compress_ratios[L]

    def kv_source(self, L: int) -> Optional[int]:
        """The layer whose compressor produced the compressed KV that layer L attends to (None: window only)."""
        if self.is_dspark(L) or self.compress_ratios[L] == 0:
            return None
        return self._last_at_or_before(self.kv_source_layers, L)

    def index_source(self, L: int) -> Optional[int]:
        """The layer whose indexer chose the compressed top-k that layer L uses."""
        if self.kv_source(L) is None:
            return None
        return self._last_at_or_before(self.index_source_layers, L)

    def uses_candidates(self, L: int) -> bool:
        """Reindex layers after the candidate source restrict their indexer to its candidate blocks."""
        return L in self.index_source_layers and 0 <= self.candidate_source_layer < L

    def attn_mode(self, L: int) -> AttnMode:
        """SPEC §0.1: 'window' (ratio 0), 'full' (own compressor + indexer), 'reindex' (own indexer
        over another layer's keys), 'reuse' (another layer's KV and top-k)."""
        if self.kv_source(L) is None:
            return "window"
        if L in self.kv_source_layers:
            return "full"
        if L in self.index_source_layers:
            return "reindex"
        return "reuse"

    def rope_params(self, L: int) -> tuple[float, bool]:
        """(base, yarn) of layer L: compressed layers use compress_rope_theta with YaRN on every q/k."""
        if self.is_dspark(L) or self.compress_ratios[L] == 0:
            return self.rope_theta, False
        return self.compress_rope_theta, True

    def moe_experts(self, L: int) -> tuple[int, int]:
        """(routed experts, experts per token) of layer L; DSpark stages have their own."""
        if self.is_dspark(L):
            return self.dspark_n_routed_experts, self.dspark_n_activated_experts
        return self.n_routed_experts, self.n_activated_experts

    def engram_index(self, L: int) -> Optional[int]:
        """Position of L in engram_layer_ids (which table it reads), or None."""
        return self.engram_layer_ids.index(L) if L in self.engram_layer_ids else None

    @property
    def layer_ids(self) -> range:
        return range(self.n_layers)

    @property
    def dspark_layer_ids(self) -> range:
        return range(self.n_layers, self.n_total_layers)

    @property
    def dense_quantized(self) -> bool:
        return self.dtype == "fp8"

    @property
    def experts_dtype(self) -> Optional[str]:
        """Storage of routed experts: expert_dtype, else the dense dtype."""
        return self.expert_dtype or self.dtype
