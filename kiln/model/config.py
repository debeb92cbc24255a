"""Shape and options of the Transformer, with presets from a CPU toy to Llama-70B."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kiln.errors import ConfigError
from kiln.model.bert_config import BertConfig
from kiln.model.t5_config import T5Config

# What a checkpointed block keeps for backward (train.activation_checkpointing): everything, what the
# op-level policy keeps (kiln.parallel.parallelize.selective_policy), or only its input. Here, the
# bottom layer, because the activation accounting (kiln.model.activations) and the planner share it.
AC_MODES = ("none", "selective", "full")

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")
# The keys each type reads beyond type and factor; any other one set is refused (it would do nothing).
ROPE_KEYS = {
    "linear": (),
    "dynamic": ("original_max_seq_len",),
    "llama3": ("original_max_seq_len", "low_freq_factor", "high_freq_factor"),
    "yarn": (
        "original_max_seq_len",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
# The type-specific keys, each once (a dict keeps their first-seen order).
ROPE_OPTIONAL = tuple(dict.fromkeys(k for keys in ROPE_KEYS.values() for k in keys if k != "original_max_seq_len"))


@dataclass
class RopeScaling:
    """RoPE context extension (docs/long_context.md): [model] rope_scaling = {type = "yarn", ...}.
    max_seq_len is then the extended context and original_max_seq_len the one trained at first."""

    type: str = ""  # linear (Chen et al. 2023) | dynamic (NTK, bloc97) | yarn (Peng et al. 2023) | llama3
    factor: float = 0.0  # context multiple the frequencies are stretched for
    original_max_seq_len: int = 0  # dynamic, yarn, llama3: the pretraining context
    low_freq_factor: float | None = None  # llama3 (default 1): wavelengths > original/this are divided by factor
    high_freq_factor: float | None = None  # llama3 (default 4): wavelengths < original/this are kept
    beta_fast: float | None = None  # yarn (default 32): rotations in the original context above which to extrapolate
    beta_slow: float | None = None  # yarn (default 1): rotations below which to interpolate
    attention_factor: float | None = None  # yarn: cos/sin scale; default 0.1 ln(factor) + 1
    mscale: float | None = None  # yarn, with mscale_all_dim (DeepSeek): attention factor mscale ratio
    mscale_all_dim: float | None = None
    truncate: bool | None = None  # yarn (default true): round the ramp's ends to whole dimensions

    @property
    def llama3_freq_factors(self) -> tuple[float, float]:
        low = 1.0 if self.low_freq_factor is None else self.low_freq_factor
        return low, 4.0 if self.high_freq_factor is None else self.high_freq_factor

    @property
    def yarn_betas(self) -> tuple[float, float]:
        return (32.0 if self.beta_fast is None else self.beta_fast), (1.0 if self.beta_slow is None else self.beta_slow)

    def validate(self, max_seq_len: int) -> None:
        if self.type not in ROPE_TYPES:
            raise ConfigError("type", f"must be one of {', '.join(ROPE_TYPES)}, got {self.type!r}")
        # factor 1 is allowed (the unscaled frequencies); below 1 would compress the context.
        if not 1 <= self.factor < math.inf:
            raise ConfigError("factor", f"must be a finite number >= 1, got {self.factor}")
        keys = ROPE_KEYS[self.type]
        for key in ("original_max_seq_len", *ROPE_OPTIONAL):
            value = getattr(self, key)
            unset = value is None or (key == "original_max_seq_len" and value == 0)
            if key not in keys and not unset:
                raise ConfigError(key, f"has no effect with type {self.type!r}; it applies to {_types_reading(key)}")
        if "original_max_seq_len" in keys and not 0 < self.original_max_seq_len <= max_seq_len:
            raise ConfigError(
                "original_max_seq_len",
                f"must be between 1 and max_seq_len={max_seq_len} (the extended context), got {self.original_max_seq_len}",
            )
        for key in (k for k in ROPE_OPTIONAL if k != "truncate"):  # the numbers
            value = getattr(self, key)
            if value is not None and not 0 < value < math.inf:
                raise ConfigError(key, f"must be a positive finite number, got {value}")
        low, high = self.llama3_freq_factors
        if not low < high:
            raise ConfigError("high_freq_factor", f"must be greater than low_freq_factor={low}, got {high}")
        fast, slow = self.yarn_betas
        if not slow < fast:
            raise ConfigError("beta_fast", f"must be greater than beta_slow={slow}, got {fast}")

    def hf_parameters(self) -> dict:
        """The rope_scaling / rope_parameters entries transformers reads (theta added by the caller)."""
        out = {"rope_type": self.type, "factor": self.factor}
        if self.type in ("yarn", "llama3"):
            out["original_max_position_embeddings"] = self.original_max_seq_len
        if self.type == "llama3":
            out["low_freq_factor"], out["high_freq_factor"] = self.llama3_freq_factors
        if self.type == "yarn":
            out["beta_fast"], out["beta_slow"] = self.yarn_betas
            out["truncate"] = self.truncate is not False
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out


def _types_reading(key: str) -> str:
    return ", ".join(t for t, keys in ROPE_KEYS.items() if key in keys)


@dataclass
class ModelConfig:
    preset: str = ""  # start from PRESETS[preset]; other keys in the recipe override it
    vocab_size: int = 0  # 0: take the trained tokenizer's size
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads (MHA); 1: MQA; in between: GQA
    ffn_hidden: int = 0  # 0: derived from dim (see ffn_hidden_size)
    ffn_multiplier: float = 1.0  # Llama-3 style scaling of the derived SwiGLU width
    multiple_of: int = 64  # round the derived FFN width up to this (matmul-friendly)
    ffn: str = "swiglu"  # swiglu | gelu
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    pos: str = "rope"  # rope | learned | sinusoidal
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # context extension (docs/long_context.md); None: plain RoPE
    max_seq_len: int = 256
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, OLMo2; docs/model.md)
    init_std: float = 0.02
    # Mixture of experts (docs/moe.md): which layers replace the dense FFN by routed SwiGLU experts.
    moe_every: int = 0  # 0: all dense; 1: every layer; 2: layers 1, 3, 5...; n: every n-th layer
    moe_layers: list[int] = field(default_factory=list)  # 0-based layer ids; when set, used instead of moe_every
    n_experts: int = 8
    moe_top_k: int = 2
    moe_hidden: int = 0  # 0: ffn_hidden_size, each expert the shape of the dense FFN it replaces
    moe_norm_topk: bool = True  # divide the k gates by their sum (Mixtral); False: raw softmax probabilities
    moe_capacity_factor: float = 0.0  # 0: dropless; cf > 0: an expert takes at most ceil(cf * tokens * k / E)
    moe_aux_loss_weight: float = 0.01  # Switch Transformer's alpha
    moe_z_loss_weight: float = 0.001  # ST-MoE's router z-loss coefficient
    moe_shared_expert: bool = False  # also a dense SwiGLU of width moe_hidden for every token (DeepSeekMoE)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_size(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.ffn == "gelu":
            return 4 * self.dim
        # SwiGLU has three matrices instead of two, so 2/3 of 4*dim keeps the parameter
        # count of a 4*dim GELU MLP (Shazeer 2020); then round up for matmul efficiency.
        hidden = int(self.ffn_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * -(-hidden // self.multiple_of)

    @property
    def moe_hidden_size(self) -> int:
        return self.moe_hidden or self.ffn_hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe_layers:
            return layer in self.moe_layers
        # Counting from 1 keeps the first layer dense whenever moe_every > 1: early-layer routing is
        # the least stable (DeepSeekMoE keeps its first layers dense for the same reason).
        return self.moe_every > 0 and (layer + 1) % self.moe_every == 0

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        """The base a recipe's [model] table starts from when it names a preset (kiln.config.build)."""
        return preset(name)

    def validate(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        for key in ("vocab_size", "n_kv_heads", "ffn_hidden"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if self.dim % self.n_heads:
            raise ConfigError("n_heads", f"must divide dim={self.dim}, got {self.n_heads}")
        if self.head_dim % 2 and self.pos == "rope":
            raise ConfigError("n_heads", f"RoPE needs an even head_dim, got dim/n_heads={self.head_dim}")
        if self.n_heads % self.kv_heads:
            raise ConfigError("n_kv_heads", f"must divide n_heads={self.n_heads}, got {self.n_kv_heads}")
        choices = {
            "ffn": ("swiglu", "gelu"),
            "norm": ("rmsnorm", "layernorm"),
            "pos": ("rope", "learned", "sinusoidal"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(key, f"must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        if self.preset and self.preset not in PRESETS:
            raise ConfigError("preset", f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        self._validate_floats()
        self._validate_moe()
        if self.qk_norm and self.norm != "rmsnorm":
            raise ConfigError("qk_norm", f"is an RMSNorm over each head; it needs norm = 'rmsnorm', got {self.norm!r}")
        if self.rope_scaling is not None:
            if self.pos != "rope":
                raise ConfigError("rope_scaling", f"scales RoPE; it needs pos = 'rope', got {self.pos!r}")
            try:
                self.rope_scaling.validate(self.max_seq_len)
            except ConfigError as err:
                raise err.within("rope_scaling") from None

    def _validate_floats(self) -> None:
        # Written as `not x > 0` so that NaN, which every comparison is false for, is refused too:
        # a config built in Python skips the recipe's refusal of non-finite numbers.
        for key in ("norm_eps", "init_std", "ffn_multiplier"):
            if not 0 < getattr(self, key) < math.inf:
                raise ConfigError(key, f"must be a positive finite number, got {getattr(self, key)}")
        # theta^(-2i/d) are the rotation frequencies: theta <= 1 turns every pair at >= 1 radian per
        # token (theta = 1: all at the same rate), and inf stops every pair but the first, leaving
        # almost no position signal.
        if not 1 < self.rope_theta < math.inf:
            raise ConfigError("rope_theta", f"must be a finite number > 1, got {self.rope_theta}")
        if self.ffn_hidden_size <= 0:
            raise ConfigError(
                "ffn_multiplier", f"gives an FFN of width {self.ffn_hidden_size}; it must be at least 1 unit wide"
            )

    def _validate_moe(self) -> None:
        for key in ("moe_every", "moe_hidden", "moe_capacity_factor", "moe_aux_loss_weight", "moe_z_loss_weight"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ConfigError(key, f"must be a finite number >= 0, got {getattr(self, key)}")
        for layer in self.moe_layers:
            if not 0 <= layer < self.n_layers:
                raise ConfigError(
                    "moe_layers", f"layer {layer} is outside 0..{self.n_layers - 1} (n_layers={self.n_layers})"
                )
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise ConfigError("moe_layers", f"lists a layer twice: {self.moe_layers}")
        if not (self.moe_every or self.moe_layers):
            return
        if self.n_experts < 1:
            raise ConfigError("n_experts", f"must be >= 1, got {self.n_experts}")
        if not 1 <= self.moe_top_k <= self.n_experts:
            raise ConfigError("moe_top_k", f"must be between 1 and n_experts={self.n_experts}, got {self.moe_top_k}")
        if self.ffn != "swiglu":
            raise ConfigError("ffn", f"MoE experts are SwiGLU; set ffn = 'swiglu' or turn MoE off, got {self.ffn!r}")


# Shapes follow the published models: GPT-2 small for 125M, Llama 3.2 1B, Llama 3 8B and 70B.
PRESETS: dict[str, ModelConfig] = {
    # Fits a 2-core CPU: ~4M non-embedding parameters train at a few thousand tokens/s in bf16.
    "tiny": ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256),
    # The tiny model with every FFN replaced by 8 experts of half the dense width, top-2: the same
    # active FFN compute per token as "tiny", four times its FFN parameters.
    "tiny-moe": ModelConfig(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=256,
        moe_every=1,
        n_experts=8,
        moe_top_k=2,
        moe_hidden=352,
    ),
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, max_seq_len=2048),
    "1b": ModelConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        rope_theta=500000.0,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    "8b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, rope_theta=500000.0, max_seq_len=8192
    ),
    "70b": ModelConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, rope_theta=500000.0, max_seq_len=8192
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError("preset", f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], preset=name, **overrides)


# ---- model families: `[model] arch` -------------------------------------------------------------

# The decoder's ModelConfig has no `arch` field, so its recipes and checkpoints read as before; every
# other family's config stores its name in `arch`.
FAMILIES: dict[str, type] = {"decoder": ModelConfig, "bert": BertConfig, "t5": T5Config}


def model_family(table: dict) -> tuple[type, dict]:
    """(config class, the table without `arch` for the decoder) of a [model] table or a checkpoint's
    model_config: `arch` names the family, "decoder" when absent."""
    arch = table.get("arch", "decoder")
    if not isinstance(arch, str) or arch not in FAMILIES:
        raise ConfigError("arch", f"unknown model family {arch!r}; known: {', '.join(FAMILIES)}")
    cls = FAMILIES[arch]
    return cls, ({k: v for k, v in table.items() if k != "arch"} if cls is ModelConfig else table)


def arch_of(cfg) -> str:
    """The family name of a model config (a ModelConfig is the decoder)."""
    return getattr(cfg, "arch", "decoder")
