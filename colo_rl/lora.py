"""LoRA through peft: which layers get adapters, and the merged weights the engine serves.

Only the adapters train; the base weights stay frozen in model.dtype. The engine never sees an
adapter: every push sends base + (alpha / rank) * B @ A, computed from the untouched base into a
fresh engine-dtype copy (merging into the base in place and unmerging after would drift by a
rounding error a step), under the base model's own Hugging Face names, so the engine's name
mapping is the one a full fine-tuning push uses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from colo_rl.config import CheckpointError, ConfigError, LoraConfig, RunConfig, trainer_dtype


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (peft is only imported once a run asked for LoRA)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_modules(model: torch.nn.Module) -> list[str]:
    """Full names of the model's linear layers, the output head included."""
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def target_modules(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """peft's target_modules for `cfg`: its names, each checked to match a linear layer (a name
    or a dotted suffix of one, as peft matches), or by default every linear layer's short name
    except the output head's. Raises ConfigError listing the model's linear layers."""
    names = linear_modules(model)
    head = model.get_output_embeddings()
    decoder = [n for n in names if model.get_submodule(n) is not head]
    short = sorted({n.rpartition(".")[2] for n in names})
    if not cfg.target_modules:
        return sorted({n.rpartition(".")[2] for n in decoder})
    unknown = [key for key in cfg.target_modules if not any(n == key or n.endswith("." + key) for n in names)]
    if unknown:
        raise ConfigError(f"trainer.lora.target_modules={list(cfg.target_modules)}: {', '.join(unknown)} "
                          f"matches no linear layer of this model; its linear layers are named "
                          f"{', '.join(short)} (leave the list empty for all of the decoder's)")
    return list(cfg.target_modules)


def check_targets(model_dir, cfg: LoraConfig, trust_remote_code: bool = False) -> None:
    """Refuse target modules that match no linear layer from the model's config alone (built on
    the meta device: no memory, milliseconds), before the engine is spawned."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    target_modules(model, cfg)


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, adapter_dtype: torch.dtype) -> torch.nn.Module:
    """`model` with LoRA adapters (peft) on the targeted layers: the adapters trainable, in
    `adapter_dtype` (fp32 under trainer.memory.precision=mixed), every other weight frozen as it was."""
    import peft

    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=target_modules(model, cfg), bias="none")
    # autocast_adapter_dtype would pick the adapters' dtype itself; the precision setting decides
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
    return model


def load_trainer_policy(settings: RunConfig, model_dir: Path, device: str) -> torch.nn.Module:
    """The policy as the trainer holds it: in trainer_dtype (fp32 masters under mixed precision),
    or under LoRA a frozen base in model.dtype with adapters in trainer_dtype. A target module
    that matches no linear layer is refused here, before any engine starts."""
    from colo_rl.models import DTYPES, load_policy

    lora = settings.trainer.lora
    if not lora.rank:
        return load_policy(settings.model, model_dir, device, dtype=trainer_dtype(settings))
    return apply_lora(load_policy(settings.model, model_dir, device), lora,
                      adapter_dtype=DTYPES[trainer_dtype(settings)])


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def hf_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, torch.nn.Module | None]]:
    """(Hugging Face name, tensor, its LoRA layer when the engine gets it merged) for every weight
    of the policy, in order; no adapter tensor itself. A plain model's are its parameters."""
    if not is_lora(model):
        return [(name, p, None) for name, p in model.named_parameters()]
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    adapters = {id(p) for m in layers.values() for name, p in m.named_parameters()
                if not name.startswith("base_layer.")}
    out = []
    for name, p in base.named_parameters():
        if id(p) in adapters:
            continue
        module, _, leaf = name.rpartition(".")
        if module.endswith(".base_layer"):
            owner = module[:-len(".base_layer")]
            out.append((f"{owner}.{leaf}", p, layers[owner] if leaf == "weight" else None))
        else:
            out.append((name, p, None))
    return out


def merged_weight(weight: torch.Tensor, layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A new `dtype` tensor: base weight + every active adapter's scaled B @ A (peft's delta),
    added in the wider of the two dtypes and rounded once, as peft's own merge rounds."""
    with torch.no_grad():
        merged = weight.detach().to(dtype, copy=True)
        for adapter in layer.active_adapters:
            merged.add_(layer.get_delta_weight(adapter))
    return merged


def checkpoint_policy(checkpoint_dir: Path, config: dict, adapters: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The LoRA policy a checkpoint of a LoRA run describes: its base model (the embedded one
    rebuilt from the checkpoint's own hf/ directory and seed, or model.path's weights) with the
    adapters `adapters` (the checkpoint's model tensors), on the CPU."""
    from omegaconf import OmegaConf

    from colo_rl.config import ModelConfig
    from colo_rl.models import load_policy, resolve_hf_model

    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), config["model"]))
    lora_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LoraConfig), config["trainer"]["lora"]))
    base_dir = checkpoint_dir / "hf" if model_cfg.source == "embedded" else resolve_hf_model(model_cfg)
    dtype = next(iter(adapters.values())).dtype
    policy = apply_lora(load_policy(model_cfg, base_dir, "cpu"), lora_cfg, adapter_dtype=dtype)
    expected = {name for name, _ in trainable_parameters(policy)}
    if set(adapters) != expected:
        raise CheckpointError(f"{checkpoint_dir / 'model.safetensors'}: its {len(adapters)} tensors are not the "
                          f"{len(expected)} adapters that trainer.lora={dict(config['trainer']['lora'])} puts on "
                          "this model. Export a checkpoint written by a LoRA run")
    policy.load_state_dict(adapters, strict=False)
    return policy

