"""`python -m colo_rl.export CHECKPOINT_DIR OUT_DIR [--dtype D]`: a Hugging Face model directory
from a colo_rl checkpoint, for transformers, vLLM or the Hub.

OUT_DIR gets config.json, the weights as safetensors (sharded past --max-shard-size, with an
index), the tokenizer files and generation_config.json: `AutoModelForCausalLM.from_pretrained`,
`AutoTokenizer.from_pretrained` and `vllm serve OUT_DIR` take it as it is. Everything comes
from the checkpoint itself (its model.safetensors and hf/), verified against its manifest
first, so the model's original directory or cache is not needed (except for a LoRA checkpoint
of a hub model: its adapters are merged into the base from model.path). `--lora adapter` writes
a LoRA checkpoint as a peft adapter directory instead, for `peft.PeftModel.from_pretrained`.

The dtype is the checkpoint's `model.dtype` (what the engine served) unless --dtype says
otherwise; under trainer.memory.precision=mixed the checkpoint holds fp32 masters, which
`--dtype float32` exports exactly.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from colo_rl.cli import run_cli
from colo_rl.lora import checkpoint_policy
from colo_rl.models import DTYPES
from colo_rl.config import ConfigError
from colo_rl.trainer.checkpoint import (HF_DIR, CheckpointError, read_config, replace_directory,
                                        verify_checkpoint)

log = logging.getLogger("colo_rl")
DEFAULT_MAX_SHARD_SIZE = "5GB"  # the Hub's usual shard size
LORA_FORMS = ("merged", "adapter")


def export_target(export_dir: str | None, output_dir: Path) -> Path:
    """Where trainer.checkpoint.export writes: trainer.checkpoint.export_dir, or OUTPUT_DIR/export."""
    return Path(export_dir) if export_dir else output_dir / "export"


def check_export_target(export_dir: str | None, output_dir: Path, resume: str | None = None) -> None:
    """trainer.checkpoint.export's target, before the engine starts: nothing the user has is replaced.
    A target that exists and is not empty is refused (as `python -m colo_rl.export` refuses it),
    and so is one that is, or holds, the run directory, its checkpoint or the one it resumes from."""
    target = export_target(export_dir, output_dir).resolve()
    key = f"trainer.checkpoint.export_dir={export_dir}" if export_dir else f"trainer.checkpoint.export (into {target})"
    for name, kept in (("the run directory", output_dir), ("its checkpoint", output_dir / "checkpoint"),
                       ("trainer.checkpoint.resume", Path(resume) if resume else None)):
        if kept is not None and (target == kept.resolve() or target in kept.resolve().parents):
            raise ConfigError(f"{key}: is or holds {name} ({kept}), which the export would replace. "
                              "Give trainer.checkpoint.export_dir a new directory of its own")
    if target.is_dir() and any(target.iterdir()):
        raise ConfigError(f"{key}: {target} exists and is not empty, and the export would replace it. "
                          "Give trainer.checkpoint.export_dir a new directory, or remove that one")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{key}: {target} is a file. Give trainer.checkpoint.export_dir a directory")


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None,
                      max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
                      lora: str = "merged") -> Path:
    """Write the Hugging Face model directory `out_dir` from `checkpoint_dir`; returns it.

    `overwrite`: replace an existing `out_dir` (in one step, as checkpoints are replaced)
    instead of refusing it. `lora`, for a LoRA run's checkpoint: "merged" writes the model with
    its adapters merged in, "adapter" a peft adapter directory instead.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if lora not in LORA_FORMS:
        raise CheckpointError(f"--lora {lora}: use one of {', '.join(LORA_FORMS)}")
    max_shard_size = _shard_size(max_shard_size)
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: is a file. Give a directory for the exported model")
    manifest = verify_checkpoint(checkpoint_dir)
    if lora == "adapter" and manifest.get("kind") != "lora":
        raise CheckpointError(f"--lora adapter: {checkpoint_dir} is a full fine-tuning checkpoint "
                              "(trainer.lora.rank=0), with no adapter to write. Export it without --lora")
    model_cfg = (read_config(checkpoint_dir) or {}).get("model", {})
    dtype = dtype or model_cfg.get("dtype") or "float32"
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype}: not a dtype colo_rl exports. Use one of "
                              f"{', '.join(DTYPES)}")
    hf = checkpoint_dir / HF_DIR
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"{hf / 'config.json'}: missing (the checkpoint was saved without its "
                              "model directory). Export a checkpoint written by a run")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir}: exists and is not empty. Give a new directory, or remove it")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    except OSError as exc:  # under a regular file, or not writable
        raise CheckpointError(f"{out_dir}: cannot be written ({exc.strerror}: {exc.filename}). Give a "
                              "directory this user can create") from None
    try:
        trust_remote_code = bool(model_cfg.get("trust_remote_code", False))
        if lora == "adapter":
            _write_adapter(checkpoint_dir, hf, tmp, trust_remote_code)
        else:
            _write_model(checkpoint_dir, manifest, hf, tmp, DTYPES[dtype], max_shard_size, trust_remote_code)
        if out_dir.exists() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        replace_directory(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported step %s of %s as %s into %s", manifest.get("step"), checkpoint_dir, dtype, out_dir)
    return out_dir


def _shard_size(size: str | int) -> int:
    """--max-shard-size ("5GB", "500MB" or bytes) in bytes; CheckpointError unless positive."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        size_bytes = convert_file_size_to_int(int(size) if str(size).isdigit() else size)
    except ValueError:
        size_bytes = 0
    if size_bytes <= 0:
        raise CheckpointError(f"--max-shard-size {size}: not a size. Give a positive size such as 5GB "
                              "or 500MB (or a number of bytes)")
    return size_bytes


def _write_model(checkpoint_dir: Path, manifest: dict, hf: Path, out: Path, dtype: torch.dtype,
                 max_shard_size: str | int, trust_remote_code: bool) -> None:
    from transformers import AutoTokenizer

    if manifest.get("kind") == "lora":
        model = _merged_lora_model(checkpoint_dir)
        model.to(dtype)
    else:
        model = _full_model(checkpoint_dir, manifest, hf, dtype, trust_remote_code)
    model.config.dtype = dtype
    model.save_pretrained(out, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(hf, trust_remote_code=trust_remote_code).save_pretrained(out)
    if (hf / "generation_config.json").is_file():  # the model's own, not one derived from config
        shutil.copyfile(hf / "generation_config.json", out / "generation_config.json")


def _full_model(checkpoint_dir: Path, manifest: dict, hf: Path, dtype: torch.dtype,
                trust_remote_code: bool) -> torch.nn.Module:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf, trust_remote_code=trust_remote_code)
    # built without memory on the meta device; the checkpoint's tensors are then assigned to it
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    tensors = load_file(str(checkpoint_dir / "model.safetensors"))
    for alias, stored in manifest.get("aliases", {}).get("model", {}).items():
        tensors[alias] = tensors[stored]
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()},
                                                strict=False, assign=True)
    if unexpected or [k for k in missing if k not in _tied_names(model)]:
        raise CheckpointError(f"{checkpoint_dir / 'model.safetensors'}: does not fit the architecture "
                              f"of {hf / 'config.json'} (missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}). Export a checkpoint written by a run")
    if missing:
        model.tie_weights()
    return model


def _merged_lora_model(checkpoint_dir: Path) -> torch.nn.Module:
    """A LoRA checkpoint holds the adapters only: the base comes from where the run had it (the
    embedded model's seeded init, or model.path), the adapters are merged into it."""
    return _lora_policy(checkpoint_dir).merge_and_unload()


def _write_adapter(checkpoint_dir: Path, hf: Path, out: Path, trust_remote_code: bool) -> None:
    """A peft adapter directory: adapter_config.json (its base: model.path for a Hugging Face model)
    and adapter_model.safetensors in the dtype the adapters trained in, with the tokenizer."""
    from transformers import AutoTokenizer

    policy = _lora_policy(checkpoint_dir)
    model_cfg = read_config(checkpoint_dir)["model"]
    policy.peft_config["default"].base_model_name_or_path = (model_cfg.get("path") if model_cfg.get("source") == "hf"
                                                             else None)
    policy.save_pretrained(out)
    AutoTokenizer.from_pretrained(hf, trust_remote_code=trust_remote_code).save_pretrained(out)


def _lora_policy(checkpoint_dir: Path) -> torch.nn.Module:
    from safetensors.torch import load_file

    saved = read_config(checkpoint_dir) or {}
    if "lora" not in saved.get("trainer", {}):
        raise CheckpointError(f"{checkpoint_dir / 'config.yaml'}: a LoRA checkpoint needs the run's "
                              "config (trainer.lora, model.*) to rebuild its base. Export a "
                              "checkpoint written by a run")
    return checkpoint_policy(checkpoint_dir, saved, load_file(str(checkpoint_dir / "model.safetensors")))


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Parameters that share another's tensor (an untied checkpoint stores them once)."""
    seen, tied = set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(name)
        seen.add(id(tensor))
    return tied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m colo_rl.export",
        description="Write a Hugging Face model directory (config, safetensors, tokenizer, generation "
                    "config) from a colo_rl checkpoint directory.")
    parser.add_argument("checkpoint_dir", help="a checkpoint/ directory written by a run")
    parser.add_argument("out_dir", help="the model directory to write (new or empty)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="default: the checkpoint's model.dtype; float32 keeps fp32 masters exactly")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help=f"largest weight file before sharding (default {DEFAULT_MAX_SHARD_SIZE})")
    parser.add_argument("--lora", choices=LORA_FORMS, default="merged",
                        help="a LoRA run's checkpoint: merged (default) writes the model with the adapters "
                             "merged in, for AutoModelForCausalLM or vLLM; adapter writes a peft adapter "
                             "directory (adapter_config.json, adapter_model.safetensors as trained, the "
                             "tokenizer) for peft.PeftModel.from_pretrained(base, OUT_DIR)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of input errors too")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run_cli(lambda: export_checkpoint(args.checkpoint_dir, args.out_dir, dtype=args.dtype,
                                      max_shard_size=args.max_shard_size, lora=args.lora),
            argv=["debug=true"] if args.debug else [])


if __name__ == "__main__":
    main()
