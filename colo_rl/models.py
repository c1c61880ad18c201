"""The policy model and its tokenizer: built locally (embedded) or found in the local HF cache.

Both the trainer and the engine read the same directory: config.json and the tokenizer files.
For the embedded model there are no weight files; the engine starts with `load_format="dummy"`
and the trainer's weights are pushed in, exactly as in real runs.
"""

from __future__ import annotations

import json
import logging
import os
import string
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from colo_rl.config import ConfigError, ModelConfig

# transformers imports torchao (when installed, for trainer.optim.name=adamw_bf16_sr) as it loads
# any model; torchao then warns about its CUDA kernels on a CPU machine and torch about its pytree
# enums: noise before the first line a user reads, about nothing colo_rl uses.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARACTERS = string.ascii_lowercase + string.digits + " :.,;?!-+=*/()'\"_#"
# A chat template in the embedded tokenizer's alphabet (lower case, no newline), so chat-format
# prompts and model.use_chat_template run end to end without a hub model.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotAvailableError(ConfigError):
    """The configured model cannot be found locally; the message says how to make it available."""


def _char_tokenizer(vocab_size: int):
    """A character-level tokenizer of exactly `vocab_size` ids (unused ids are named fillers)."""
    from tokenizers import Tokenizer, decoders, models

    symbols = [PAD, BOS, EOS, *CHARACTERS]
    if len(symbols) > vocab_size:
        raise ConfigError(f"model.embedded.vocab_size={vocab_size} must be at least {len(symbols)} "
                          "(the built-in character set)")
    symbols += [f"<unused{i}>" for i in range(vocab_size - len(symbols))]
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    tok.add_special_tokens([PAD, BOS, EOS])
    tok.decoder = decoders.Fuse()
    return tok


def write_embedded_model(cfg: ModelConfig, directory: str | os.PathLike) -> Path:
    """Write config.json and tokenizer files of the embedded OLMo-2 policy into `directory`."""
    from transformers import Olmo2Config, PreTrainedTokenizerFast

    e = cfg.embedded
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=_char_tokenizer(e.vocab_size),
                                     bos_token=BOS, eos_token=EOS, pad_token=PAD)
    hf_tok.model_max_length = e.max_position_embeddings
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(path)
    config = Olmo2Config(
        vocab_size=e.vocab_size, hidden_size=e.hidden_size, intermediate_size=e.intermediate_size,
        num_hidden_layers=e.num_hidden_layers, num_attention_heads=e.num_attention_heads,
        num_key_value_heads=e.num_key_value_heads, max_position_embeddings=e.max_position_embeddings,
        pad_token_id=hf_tok.pad_token_id, bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id, tie_word_embeddings=False, torch_dtype=cfg.dtype,
    )
    config.architectures = ["Olmo2ForCausalLM"]
    config.save_pretrained(path)
    return path


def _looks_like_a_path(path: str) -> bool:
    """A Hugging Face id is `name` or `org/name`; anything else the user meant as a directory."""
    return (os.path.isabs(path) or path.startswith(("./", "../", "~")) or path.count("/") > 1
            or os.sep != "/" and os.sep in path)


def resolve_hf_model(cfg: ModelConfig) -> Path:
    """The local directory of `cfg.path`: the directory itself or its snapshot in the HF cache.

    Never downloads; a model that is not here stops the run with one message saying what to do.
    """
    path = os.path.expanduser(cfg.path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotAvailableError(f"model.path={cfg.path}: the directory has no config.json. "
                                         "Point it at a Hugging Face model directory")
        return Path(path)
    if _looks_like_a_path(cfg.path):
        raise ModelNotAvailableError(f"model.path={cfg.path}: the directory does not exist. Point it "
                                     "at a local Hugging Face model directory, or give a hub id "
                                     "(org/name) that is in the local cache")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(cfg.path, local_files_only=True))
    except HFValidationError as exc:
        raise ModelNotAvailableError(f"model.path={cfg.path}: neither a local directory nor a "
                                     f"Hugging Face id ({exc}). Give a model directory or an "
                                     "org/name id") from exc
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ModelNotAvailableError(
            f"model.path={cfg.path} is not in the local Hugging Face cache ({HF_HUB_CACHE}). "
            f"Make it available with `hf download {cfg.path}` on a machine with hub "
            f"access (then copy the cache or set HF_HOME), or set model.path to a local model "
            f"directory. Nothing was started."
        ) from exc


def prepare_model_dir(cfg: ModelConfig, output_dir: str | os.PathLike) -> Path:
    """The directory both trainer and engine load the policy's config and tokenizer from."""
    if cfg.source == "embedded":
        return write_embedded_model(cfg, Path(output_dir) / "embedded_model")
    return resolve_hf_model(cfg)


def load_tokenizer(cfg: ModelConfig, model_dir: Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or model_dir,
                                        trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(cfg: ModelConfig, model_dir: Path, device: str, dtype: str | None = None) -> torch.nn.Module:
    """The trainer's policy: random init for the embedded model (seeded), pretrained otherwise.
    `dtype`: its parameters' dtype (config.trainer_dtype: float32 masters under mixed precision);
    default model.dtype."""
    dtype = DTYPES[dtype or cfg.dtype]
    if cfg.source == "embedded":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        # Initialised where it will live: on a GPU the init runs there, not on the CPU first (a
        # 7B shape's CPU init takes minutes). Seeded either way: the same init_seed gives the same
        # weights on the same kind of device, but a GPU's numbers are not the CPU's (another
        # random generator); on the CPU they are what they always were.
        target = torch.device(device)
        on_cuda = target.type == "cuda"
        rng_devices = [target.index if target.index is not None else torch.cuda.current_device()] if on_cuda else []
        with torch.random.fork_rng(devices=rng_devices), (target if on_cuda else nullcontext()):
            torch.manual_seed(cfg.embedded.init_seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                     trust_remote_code=cfg.trust_remote_code)
    return model.to(device)


def model_summary(model_dir: Path) -> dict:
    with open(model_dir / "config.json") as f:
        return json.load(f)
