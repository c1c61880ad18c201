"""Export: a checkpoint of a trained policy becomes a Hugging Face model directory that
transformers and vLLM load as they are, with the trainer's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from colo_rl.config import ConfigError, ModelConfig, TrainerConfig, validate
from colo_rl.export import export_checkpoint
from colo_rl.models import load_policy, load_tokenizer, write_embedded_model
from colo_rl.run import train
from colo_rl.trainer import CheckpointError, GRPOTrainer, save_checkpoint

from .conftest import ROOT, compose_config, small_run_overrides
from .generator.test_generator import hf_greedy

PROMPTS = [[5, 6, 7], [8, 9]]
BATCHES = [([[10, 11, 2], [12], [13, 14, 15, 16], [17, 2]], [1.0, 0.0, 0.0, 1.0]),
           ([[20, 2], [21, 22], [23], [24, 25, 26]], [0.0, 1.0, 1.0, 0.0])]
INPUT = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trainer after two GRPO steps and its checkpoint, saved with a config whose model.dtype
    is bfloat16 while the trainer keeps fp32 masters (trainer.memory.precision=mixed)."""
    tmp = tmp_path_factory.mktemp("trained")
    model_dir = write_embedded_model(ModelConfig(), tmp / "model")
    trainer = GRPOTrainer(load_policy(ModelConfig(), model_dir, "cpu"), TrainerConfig(),
                          pad_token_id=0, temperature=1.0, max_tokens=8, device="cpu")
    for completions, rewards in BATCHES:
        trainer.train_step(PROMPTS, completions, rewards, 2)
    config = OmegaConf.to_container(compose_config("model.dtype=bfloat16"), resolve=True)
    checkpoint = save_checkpoint(tmp / "checkpoint", trainer, {"step": 2}, config=config,
                                 model_dir=model_dir)
    return trainer, checkpoint


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT).logits.float()


def test_a_float32_export_gives_the_trainers_logits_exactly(trained, tmp_path):
    trainer, checkpoint = trained
    out = export_checkpoint(checkpoint, tmp_path / "fp32", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    assert torch.equal(logits(model), logits(trainer.model))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("abc").input_ids == load_tokenizer(ModelConfig(), checkpoint / "hf")("abc").input_ids
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>"
    assert (out / "generation_config.json").is_file()


def test_the_default_dtype_is_model_dtype_within_bf16_tolerance(trained, tmp_path):
    trainer, checkpoint = trained
    out = export_checkpoint(checkpoint, tmp_path / "bf16")  # the checkpoint's model.dtype
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(out / "model.safetensors")
    for name, master in trainer.model.state_dict().items():
        assert torch.equal(weights[name], master.to(torch.bfloat16)), name  # one rounding, no more
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    reference = logits(trainer.model)
    # bf16 keeps 8 significant bits: weights and activations each rounded at 2^-8 relative
    assert (logits(model) - reference).abs().max() <= 0.05 * reference.abs().max()


def test_large_models_are_sharded_with_an_index(trained, tmp_path):
    _, checkpoint = trained
    out = export_checkpoint(checkpoint, tmp_path / "sharded", dtype="float32", max_shard_size="400KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(model), logits(AutoModelForCausalLM.from_pretrained(
        export_checkpoint(checkpoint, tmp_path / "whole", dtype="float32"))))


def test_export_refuses_a_non_empty_target_and_a_changed_checkpoint(trained, tmp_path):
    _, checkpoint = trained
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'busy'}: exists and is not empty"):
        export_checkpoint(checkpoint, tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        export_checkpoint(tmp_path, tmp_path / "out")


def test_the_export_command_line(trained, tmp_path):
    _, checkpoint = trained
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(ROOT)
    ok = subprocess.run([sys.executable, "-m", "colo_rl.export", str(checkpoint), str(tmp_path / "out"),
                         "--dtype", "float32"], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (tmp_path / "out" / "config.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "colo_rl.export", str(tmp_path / "nothing"),
                          str(tmp_path / "out2")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert f"colo_rl: error: {tmp_path / 'nothing'}: not a checkpoint directory" in bad.stderr


def test_export_dir_without_export_final_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="trainer.checkpoint.export_dir=.* is set but trainer.checkpoint.export=false"):
        validate(compose_config(f"trainer.checkpoint.export_dir={tmp_path}"))
    with pytest.raises(ConfigError, match="trainer.checkpoint.final=False but trainer.checkpoint.export=true"):
        validate(compose_config("trainer.checkpoint.export=true", "trainer.checkpoint.final=false"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="trainer.checkpoint.export_dir=.* is a file"):
        validate(compose_config("trainer.checkpoint.export=true", f"trainer.checkpoint.export_dir={tmp_path / 'file'}"))


VLLM_GREEDY = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", seed=0, max_model_len=256, enforce_eager=True,
          distributed_executor_backend="uni")
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])], params)
print("TOKENS" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.mark.slow
def test_a_run_with_export_final_leaves_a_model_vllm_serves_with_the_trainers_greedy_tokens(tmp_path, engine):
    """A real run (trainer.checkpoint.export=true), then a vLLM engine of its own started from the
    exported directory with its real weights (load_format auto, as `vllm serve` would): its
    greedy tokens equal Hugging Face greedy decoding with the checkpoint's (the trainer's)
    weights."""
    # '=' is a character the initial policy samples often (the default 'a' it may not sample in
    # two steps: all rewards 0, no update), and a large lr: two steps move the greedy tokens
    train(compose_config(*small_run_overrides(tmp_path / "run", "logger=none", "trainer.steps=2",
                                              "task.toy.target='='", "trainer.lr=0.05",
                                              "trainer.checkpoint.export=true")), engine)
    out = tmp_path / "run" / "export"
    weights = load_file(out / "model.safetensors")
    trained_weights = load_file(tmp_path / "run" / "checkpoint" / "model.safetensors")
    assert weights.keys() == trained_weights.keys()
    assert all(torch.equal(weights[k], trained_weights[k]) for k in weights)  # model.dtype=float32

    policy = load_policy(ModelConfig(), out, "cpu")
    policy.load_state_dict(trained_weights)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [20, 21, 22, 23, 24]]
    expected = [hf_greedy(policy, p, 12) for p in prompts]
    assert expected != [hf_greedy(load_policy(ModelConfig(), out, "cpu"), p, 12) for p in prompts]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", CUDA_VISIBLE_DEVICES="",
               TOKENIZERS_PARALLELISM="false")
    served = subprocess.run([sys.executable, "-c", VLLM_GREEDY, str(out), json.dumps(prompts)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert served.returncode == 0, served.stderr[-3000:]
    line = next(x for x in served.stdout.splitlines() if x.startswith("TOKENS"))
    assert json.loads(line[len("TOKENS"):]) == expected


def test_a_lora_checkpoint_exports_its_adapters_merged_into_the_base(tmp_path):
    """The checkpoint holds the adapters only; export rebuilds the base (the embedded model's
    seeded init) and merges them: the logits of the model the adapters trained."""
    import copy

    from colo_rl.config import LoraConfig
    from colo_rl.lora import apply_lora

    model_dir = write_embedded_model(ModelConfig(), tmp_path / "model")
    policy = apply_lora(load_policy(ModelConfig(), model_dir, "cpu"), LoraConfig(rank=8),
                        adapter_dtype=torch.float32)
    trainer = GRPOTrainer(policy, TrainerConfig(lr=1e-2), pad_token_id=0, temperature=1.0,
                          max_tokens=8, device="cpu")
    for completions, rewards in BATCHES:
        trainer.train_step(PROMPTS, completions, rewards, 2)
    config = OmegaConf.to_container(compose_config("trainer.lora.rank=8", "trainer.lr=1e-2"), resolve=True)
    checkpoint = save_checkpoint(tmp_path / "checkpoint", trainer, {"step": 2}, config=config,
                                 model_dir=model_dir)
    out = export_checkpoint(checkpoint, tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in exported.named_parameters())
    merged = copy.deepcopy(trainer.model).merge_and_unload()
    assert torch.equal(logits(exported), logits(merged))
    base = load_policy(ModelConfig(), model_dir, "cpu")
    assert not torch.equal(logits(exported), logits(base))  # the adapters trained and are in it
