"""Every YAML composes; bad values fail at compose or validate time, naming the key."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from colo_rl.config import ConfigError, RunConfig, validate

from .conftest import CONF, EXPERIMENTS, compose_config, engine_processes

CHOICES = sorted({(p.parent.name, p.stem) for p in CONF.glob("*/*.yaml") if p.parent.name != "hydra"})
EXPERIMENT_NAMES = sorted(p.stem for p in (EXPERIMENTS / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("group,choice", CHOICES, ids=[f"{g}={c}" for g, c in CHOICES])
def test_every_group_option_composes_and_validates(group, choice, tmp_path):
    overrides = [f"{group}={choice}"]
    if (group, choice) in (("task", "gsm8k"), ("task", "dataset")):
        data = tmp_path / "gsm8k.jsonl"
        data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
        overrides.append(f"task.dataset.path={data}")
    if (group, choice) == ("task", "dataset"):
        overrides.append("task.rewards=[my_rewards:correct]")
    cfg = compose_config(*overrides)
    settings = validate(cfg)
    assert isinstance(settings, RunConfig)
    node = getattr(settings, group)
    if group in ("model", "sampling", "task"):  # groups whose options carry their own name
        assert node.name == choice


@pytest.mark.parametrize("name", EXPERIMENT_NAMES)
def test_every_experiment_composes(name, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    cfg = compose_config(f"experiment={name}", f"task.dataset.path={data}") if "gsm8k" in name else \
        compose_config(f"experiment={name}")
    validate(cfg)
    first_line = (EXPERIMENTS / "experiment" / f"{name}.yaml").read_text().splitlines()[1]
    assert first_line.startswith("# python -m colo_rl.run") and f"experiment={name}" in first_line


def test_every_yaml_opens_with_the_command_that_runs_it():
    for path in CONF.glob("**/*.yaml"):
        if path.parent.name == "hydra":
            continue
        text = path.read_text()
        if path.parent.name == "algo":  # `# @package _global_` first: Hydra reads a header only there
            text = text.removeprefix("# @package _global_\n")
        assert text.startswith("# python -m colo_rl.run"), path


def test_memory_fraction_sweep_declares_its_grid():
    with_hydra = compose_config("experiment=memory_fraction_sweep")
    assert with_hydra.model.name == "olmo2_1b_shape"


def test_engine_kwargs_as_the_readme_adds_them_reach_the_generator_config():
    cfg = compose_config("+generator.engine_kwargs.compilation_config={cudagraph_mode: FULL_DECODE_ONLY}",
                         "+generator.engine_kwargs.max_num_batched_tokens=8192")
    assert validate(cfg).generator.engine_kwargs == {
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}, "max_num_batched_tokens": 8192}


def test_a_sweep_over_the_optimizer_presets_composes_one_job_per_optimizer():
    # `python -m colo_rl.run -m trainer/optim=adamw,adamw_8bit`: the basic sweeper's jobs, composed
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(["trainer/optim=adamw,adamw_8bit,adamw_bf16_sr",
                                                       "trainer.optim.weight_decay=0.1"])
    jobs = BasicSweeper.split_arguments(parsed, None)[0]
    trainers = [OmegaConf.to_object(compose_config(*job)).trainer for job in jobs]
    assert [t.optim.name for t in trainers] == ["adamw", "adamw_8bit", "adamw_bf16_sr"]
    # a preset swaps the optimizer; the other optim keys stay the run's
    assert all(t.optim.weight_decay == 0.1 and t.optim.betas == [0.9, 0.999] and t.lr == 1e-3 for t in trainers)


def test_a_checkpoints_config_of_the_old_layout_reads_in_the_new_one():
    from colo_rl.config_moves import translate

    from tests.configs import old_layout

    composed = OmegaConf.to_container(compose_config(), resolve=True)
    assert "checkpoint_every" in old_layout(composed)["trainer"]
    assert translate(old_layout(composed)) == composed and translate(composed) == composed


def test_typo_in_a_key_fails_at_compose_naming_it():
    with pytest.raises(ConfigCompositionException, match="generator.gpu_memory_utilizaton"):
        compose_config("generator.gpu_memory_utilizaton=0.3")


def test_wrong_type_fails_at_compose_naming_the_key():
    with pytest.raises(ConfigCompositionException, match="trainer.steps"):
        compose_config("trainer.steps=many")


@pytest.mark.parametrize("override,key", [
    ("trainer.algo.advantage_std=sample", "trainer.algo.advantage_std='sample' must be one of unbiased, population"),
    ("trainer.algo.clip_eps_high=-0.1", "trainer.algo.clip_eps_high=-0.1 must be null"),
    ("trainer.algo.tis_cap=0", "trainer.algo.tis_cap=0.0 must be null .off. or > 0"),
    ("trainer.optim.lr_schedule=step", "trainer.optim.lr_schedule='step' must be one of constant, linear, cosine"),
    ("trainer.optim.warmup_steps=-1", "trainer.optim.warmup_steps=-1 must be in [[]0, trainer.steps=30[)]"),
    ("trainer.optim.warmup_steps=30", "trainer.optim.warmup_steps=30 must be in [[]0, trainer.steps=30[)]"),
    ("trainer.optim.max_nonfinite_steps=0", "trainer.optim.max_nonfinite_steps=0 must be >= 1"),
])
def test_grpo_numerics_keys_out_of_range_fail_in_validate_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        validate(compose_config(override))


def test_truncated_importance_sampling_needs_the_engines_logprobs_at_the_trainers_temperature():
    with pytest.raises(ConfigError, match="sampling.logprobs=False must be true with trainer.algo.tis_cap=2.0"):
        validate(compose_config("trainer.algo.tis_cap=2", "sampling.logprobs=false"))
    with pytest.raises(ConfigError, match="sampling.temperature=0.7 needs "
                                          r"generator.engine_kwargs.logprobs_mode=processed_logprobs"):
        validate(compose_config("trainer.algo.tis_cap=2", "sampling.temperature=0.7",
                                "+generator.engine_kwargs.logprobs_mode=raw_logprobs"))
    validate(compose_config("trainer.algo.tis_cap=2", "sampling.temperature=0.7"))
    assert validate(compose_config("trainer.algo.tis_cap=2")).trainer.algo.tis_cap == 2.0


def test_engine_logprobs_are_asked_for_every_kth_step_and_every_step_under_tis():
    from colo_rl.rollout import logprobs_due

    def due(*overrides):
        settings = validate(compose_config(*overrides))
        return [step for step in range(25) if logprobs_due(settings, step)]

    assert due() == [0, 10, 20]  # null: every 10th step without TIS
    assert due("sampling.logprobs_every=4") == [0, 4, 8, 12, 16, 20, 24]
    assert due("sampling.logprobs_every=1") == list(range(25))
    assert due("trainer.algo.tis_cap=2") == list(range(25))  # null with TIS: every step
    assert due("trainer.algo.tis_cap=2", "sampling.logprobs_every=1") == list(range(25))
    assert due("sampling.logprobs=false", "sampling.logprobs_every=1") == []
    with pytest.raises(ConfigError, match=r"sampling.logprobs_every=5 must be 1 or null with "
                                          r"trainer.algo.tis_cap=2.0 .*set sampling.logprobs_every=null"):
        validate(compose_config("trainer.algo.tis_cap=2", "sampling.logprobs_every=5"))
    with pytest.raises(ConfigError, match="sampling.logprobs_every=0 must be null"):
        validate(compose_config("sampling.logprobs_every=0"))


def test_a_step_is_seeded_once_per_rank_or_once_per_prompt_by_seed_scope():
    from colo_rl.rollout import prompt_seeds, step_seed

    s = validate(compose_config("sampling.n=4")).sampling
    assert s.seed_scope == "batch"  # the default: one seed per step and rank, the engine's full speed
    seeds = {step_seed(s, step, 8, slice(0, 4), rank) for step in range(5) for rank in range(2)}
    assert len(seeds) == 10 and all(isinstance(x, int) and 0 <= x < 2**31 for x in seeds)
    assert step_seed(s, 3, 8, slice(0, 4), 0) == step_seed(s, 3, 8, slice(4, 8), 0)  # a step repeats
    p = validate(compose_config("sampling.n=4", "sampling.seed_scope=prompt")).sampling
    assert step_seed(p, 3, 8, slice(4, 8), 1) == prompt_seeds(0, 3, 8, 4)[4:8]
    assert step_seed(validate(compose_config("sampling.seed=null")).sampling, 3, 8, slice(0, 8), 0) is None


@pytest.mark.parametrize("override,key", [
    ("generator.gpu_memory_utilization=1.3", "generator.gpu_memory_utilization=1.3 must be in"),
    ("generator.weight_sync=nccl", "generator.weight_sync"),
    ("trainer.lr=-1", "trainer.lr"),
    ("sampling.top_p=0", "sampling.top_p"),
    ("sampling.seed_scope=request", "sampling.seed_scope='request' must be one of batch, prompt"),
    ("sampling.max_tokens=300", "sampling.max_tokens=300 must be below generator.max_model_len"),
    ("trainer.memory.offload=everything", "trainer.memory.offload"),
    ("task.toy.target=ab", "task.toy.target"),
    ("task.kind=csv", "task.kind"),
    ("task.rewards=[]", "task.rewards"),
    ("task.reward_weights=[1.0,2.0]", "task.reward_weights"),
    ("task.max_prompt_tokens=0", "task.max_prompt_tokens"),
    ("task.max_prompt_tokens=250", "task.max_prompt_tokens=250 \\+ sampling.max_tokens=16 exceed generator.max_model_len=256"),
    ("task.kind=dataset", "task.dataset.path"),
    ("eval.every=-1", "eval.every"),
    ("eval.size=0", "eval.size"),
    ("eval.n=4", "eval.n=4 must be 1 with eval.temperature=0"),
    ("logger.log_completions=-1", "logger.log_completions"),
    ("model.prompt_template=no_placeholder", "model.prompt_template"),
    ("generator.python=/nonexistent/python", "generator.python"),
    ("trainer.checkpoint.resume=/nonexistent/checkpoint", "trainer.checkpoint.resume"),
    ("trainer.parallel=zero3", "trainer.parallel"),
])
def test_out_of_range_values_fail_in_validate_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        validate(compose_config(override))


def test_contradictions_are_refused_naming_both_keys():
    with pytest.raises(ConfigError, match="sampling.n=1 .*trainer.algo.advantage_norm=std"):
        validate(compose_config("sampling=greedy", "trainer.algo.advantage_norm=std"))
    with pytest.raises(ConfigError, match="cuda_ipc.*trainer.device=cpu"):
        validate(compose_config("generator.weight_sync=cuda_ipc", "trainer.device=cpu"))
    with pytest.raises(ConfigError, match="trainer.memory.offload='all' must be none with trainer.parallel=fsdp"):
        validate(compose_config("trainer.parallel=fsdp", "trainer.memory.offload=all"))
    with pytest.raises(ConfigError, match="trainer.algo.kl_coef=0.1 must be 0 with trainer.parallel=fsdp"):
        validate(compose_config("trainer.parallel=fsdp", "trainer.memory.offload=none", "trainer.algo.kl_coef=0.1"))


def test_data_parallel_outside_torchrun_stops_before_any_engine_saying_how_to_run_it(tmp_path, monkeypatch):
    from colo_rl.parallel import ParallelError
    from colo_rl.run import train

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    before = engine_processes()
    with pytest.raises(ParallelError, match="torchrun --nproc_per_node=N -m colo_rl.run trainer.parallel=ddp"):
        train(compose_config("trainer.parallel=ddp", f"output_dir={tmp_path}", "logger=none"))
    assert engine_processes() == before and not (tmp_path / "engine.log").exists()


def test_greedy_sampling_is_one_completion_at_temperature_zero():
    settings = validate(compose_config("sampling=greedy"))
    assert settings.sampling.n == 1 and settings.sampling.temperature == 0.0


def test_composed_config_resolves_to_plain_containers_for_wandb():
    container = OmegaConf.to_container(compose_config(), resolve=True)
    assert container["generator"]["gpu_memory_utilization"] == "auto"
    assert container["model"]["name"] == "tiny"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal where torch sees no GPU")
@pytest.mark.parametrize("key", ["trainer.device", "generator.device"])
def test_cuda_on_a_machine_without_cuda_is_refused_naming_the_key(key):
    with pytest.raises(ConfigError, match=rf"{key}=cuda, but torch sees no CUDA GPU on this machine: "
                                          rf"use {key}=auto"):
        validate(compose_config(f"{key}=cuda", "generator.weight_sync=file"))


@pytest.mark.parametrize("task", ["target_char", "copy"])
def test_an_empty_alphabet_is_refused_naming_the_key(task):
    with pytest.raises(ConfigError, match=r"task.toy.alphabet='' must hold at least one character"):
        validate(compose_config(f"task={task}", "task.toy.alphabet="))


def test_a_generator_python_without_the_workers_dependencies_is_refused_saying_what_to_install(tmp_path):
    """A real interpreter without vllm (a fresh venv), and a program that is no Python at all."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    bare = tmp_path / "venv" / "bin" / "python"
    with pytest.raises(ConfigError, match=rf"generator.python={bare} cannot import vllm, torch, "
                                          rf"safetensors, psutil, hydra, omegaconf, which colo_rl's "
                                          rf"engine worker needs: install them there \(`{bare} -m pip "
                                          r"install vllm torch safetensors psutil hydra-core omegaconf`\)"):
        validate(compose_config(f"generator.python={bare}"))
    with pytest.raises(ConfigError, match="generator.python=/bin/true is not a Python interpreter"):
        validate(compose_config("generator.python=/bin/true"))
    validate(compose_config(f"generator.python={sys.executable}"))
