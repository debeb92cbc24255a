"""Parameter-efficient fine-tuning: LoRA / rsLoRA, QLoRA (NF4 base, double quantisation), bottleneck
adapters, and saving only the trainable weights (Kiln's format, or Hugging Face PEFT's for LoRA).

Typical use, on a Kiln Transformer with its pretrained weights loaded:

    from kiln.peft import PeftConfig, apply_peft, save_peft_adapter
    model = apply_peft(model, PeftConfig(method="lora", r=8, alpha=16))
    ...train (only requires_grad parameters)...
    save_peft_adapter(model, model.cfg, "out/adapter")   # loads with peft onto kiln.hf.export_hf's model

Importing the package does not import torch; the names below load their module on first use.
See docs/peft.md.
"""

from kiln.peft.config import METHODS, PeftConfig, lora_scaling

_EXPORTS = {
    "kiln.peft.apply": ("apply_peft", "lora_config", "trainable_parameters", "parameter_counts", "peft_disabled"),
    "kiln.peft.lora": (
        "LoRAConfig",
        "LoRALinear",
        "apply_lora",
        "merge_lora",
        "unmerge_lora",
        "lora_state_dict",
        "load_lora_state_dict",
        "lora_modules",
        "set_lora",
    ),
    "kiln.peft.nf4": (
        "NF4Linear",
        "quantize_base",
        "quantize_nf4",
        "dequantize_nf4",
        "nf4_bits_per_param",
        "NF4_LEVELS",
    ),
    "kiln.peft.adapter": (
        "AdapterConfig",
        "BottleneckAdapter",
        "apply_adapters",
        "adapter_state_dict",
        "load_adapter_state_dict",
        "adapter_modules",
    ),
    "kiln.peft.load": ("load_model", "load_into", "plain_weights"),
    "kiln.peft.peft_io": (
        "save_peft_adapter",
        "load_peft_adapter",
        "save_trainable",
        "load_trainable",
        "peft_state_dict",
        "merged_state_dict",
        "folded_state_dict",
        "base_state_dict",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kiln.peft' has no attribute {name!r}")


__all__ = ["METHODS", "PeftConfig", "lora_scaling", *_WHERE]
