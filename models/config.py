"""The text-model configuration: one frozen record, read from a Hugging Face config.json-style dict.

Both loaders meet here: the HF loader passes config.json as a dict, the GGUF loader builds the same kind
of dict (``model_type`` plus HF field names). Everything the model code switches on is an explicit
field, so ``llama.py`` never looks at ``model_type`` strings scattered through a dict.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# HF class names, for dicts that carry ``architectures`` but no ``model_type``.
_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Keys of a rope dict that describe the base frequency, not the scaling; kept out of ``rope_scaling``.
_ROPE_BASE_KEYS = ("rope_theta", "rope_type", "type")


@dataclasses.dataclass(frozen=True)
class TextModelConfig:
    """Everything needed to build a decoder-only text model and its KV cache.

    Hashable (every field is immutable), so it can be a static argument of a jitted function.
    """

    architecture: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE; else HF's scaling dict frozen as sorted (key, value) pairs, with the type
    # under "rope_type" (see rope_scaling_dict()).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 when set)
    o_proj_bias: bool = False  # bias on the attention output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama's mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # window size in tokens, None = full attention
    # Per-layer "full_attention" / "sliding_attention"; None means every layer uses ``sliding_window``.
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    checkpoint_dtype: str | None = None  # config.json's torch_dtype/dtype, for dtype="auto"
    # Multimodal RoPE (Qwen2-VL): how many rotary frequencies follow the temporal, height and width
    # position rows (sums to head_dim // 2); None: one position row, plain RoPE.
    mrope_section: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; only 'silu' is")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}"
            )

        if self.mrope_section is not None and 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(
                f"mrope_section={list(self.mrope_section)} must sum to head_dim // 2 = {self.head_dim // 2}"
            )

    # ----- derived values -----

    @property
    def rope_type(self) -> str:
        return self.rope_scaling_dict().get("rope_type", "default")

    def rope_scaling_dict(self) -> dict[str, Any]:
        """The rope scaling parameters as a plain dict ({} for plain RoPE)."""
        return dict(self.rope_scaling or ())

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of one layer: None for full attention."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    # ----- construction -----

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> "TextModelConfig":
        """Read a config.json-style dict (transformers 4 or 5 field names)."""
        arch = _model_type(d)
        num_heads = int(_require(d, "num_attention_heads"))
        hidden = int(_require(d, "hidden_size"))
        num_kv = d.get("num_key_value_heads") or num_heads
        head_dim = d.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope(d)
        num_layers = int(_require(d, "num_hidden_layers"))

        attention_bias = bool(d.get("attention_bias", False))
        sliding_window = d.get("sliding_window")
        layer_types = d.get("layer_types")
        if arch in ("qwen2", "qwen3"):
            # Qwen's window is off unless use_sliding_window, and then only from max_window_layers on.
            if not d.get("use_sliding_window", False):
                sliding_window = None
            if layer_types is None and sliding_window is not None:
                first = int(d.get("max_window_layers", num_layers))
                layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        if sliding_window is None or (layer_types is not None and "sliding_attention" not in layer_types):
            sliding_window, layer_types = None, None

        return cls(
            architecture=arch,
            vocab_size=int(_require(d, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_require(d, "intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(num_kv),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else attention_bias,
            o_proj_bias=False if arch == "qwen2" else attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=None if sliding_window is None else int(sliding_window),
            layer_types=None if layer_types is None else tuple(layer_types),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_int_tuple(d.get("eos_token_id")),
            hidden_act=d.get("hidden_act", "silu"),
            checkpoint_dtype=_dtype_name(d.get("torch_dtype") or d.get("dtype")),
        )


def _model_type(d: Mapping[str, Any]) -> str:
    model_type = d.get("model_type")
    if model_type is None:
        for cls_name in d.get("architectures") or ():
            if cls_name in _ARCHITECTURE_CLASSES:
                return _ARCHITECTURE_CLASSES[cls_name]
        raise ValueError(
            f"config has no model_type (architectures={d.get('architectures')!r}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def _require(d: Mapping[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"model config is missing the required field {key!r}")
    return d[key]


def _rope(d: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, frozen scaling) from either transformers-5 ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` pair."""
    params = dict(d.get("rope_parameters") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(
            "per-layer-type rope_parameters (a dict of dicts) are not supported; "
            f"got keys {sorted(params)}"
        )
    scaling = dict(d.get("rope_scaling") or {})
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    rest = {k: _freeze(v) for k, v in merged.items() if k not in _ROPE_BASE_KEYS}
    if rope_type == "default":
        return float(theta), None
    return float(theta), tuple(sorted({**rest, "rope_type": rope_type}.items()))


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, Mapping):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


def _int_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return (int(v),)


def _dtype_name(v: Any) -> str | None:
    if v is None:
        return None
    return str(v).removeprefix("torch.")
