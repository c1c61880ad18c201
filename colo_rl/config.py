"""Typed schemas for every config group, registered in Hydra's ConfigStore.

`conf/run.yaml` starts its defaults list with `colo_rl_schema`, so every group's YAML and every
command-line override merges into these dataclasses: an unknown key or a wrong type fails at
compose time, naming the key. Single-field range checks live in `__post_init__` and run when
`validate(cfg)` turns the composed config into objects; cross-field rules live in `validate`.
Both run before any engine or GPU work starts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import FrozenInstanceError, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf


class Freezable:
    """A config group that can be frozen once its `auto`s are resolved (colo_rl/resolve.py):
    assigning to a frozen one raises. dataclasses.replace gives a new, unfrozen one."""

    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise FrozenInstanceError(f"cannot assign to {type(self).__name__}.{name}: the resolved "
                                      "settings are frozen (colo_rl/resolve.py decides every auto)")
        super().__setattr__(name, value)


def freeze(settings):
    """`settings` and every config group inside it, frozen in place; returns it."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        if is_dataclass(value):
            freeze(value)
    object.__setattr__(settings, "_frozen", True)
    return settings


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and what to do."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be written or read, or does not fit this run; the message names the
    file or the keys and what to do."""


def _check(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} {rule}")


def _one_of(key: str, value: Any, choices: tuple) -> None:
    _check(value in choices, key, value, f"must be one of {', '.join(map(str, choices))}")


@dataclass
class EmbeddedModelConfig(Freezable):
    """Shape of a randomly initialised OLMo-2 policy built locally (no hub needed)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    vocab_size: int = 64  # a character-level tokenizer is built to exactly this size
    max_position_embeddings: int = 512
    init_seed: int = 0

    def __post_init__(self) -> None:
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings"):
            _check(getattr(self, key) > 0, f"model.embedded.{key}", getattr(self, key), "must be > 0")
        _check(self.hidden_size % self.num_attention_heads == 0, "model.embedded.hidden_size",
               self.hidden_size, f"must be divisible by num_attention_heads={self.num_attention_heads}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0,
               "model.embedded.num_key_value_heads", self.num_key_value_heads,
               f"must divide num_attention_heads={self.num_attention_heads}")


@dataclass
class ModelConfig(Freezable):
    """The policy: where its weights and tokenizer come from, and how prompts are wrapped."""

    name: str = "tiny"
    # "embedded": build `embedded` locally with random weights; "hf": `path` is a Hugging Face id
    # (looked up in the local cache only) or a local directory.
    source: str = "embedded"
    path: Optional[str] = None
    tokenizer: Optional[str] = None  # default: same as path
    # What the engine serves and an export writes by default: float32 | bfloat16 | float16. The
    # trainer's own precision is trainer.precision (fp32 master weights by default under bf16/fp16).
    dtype: str = "float32"
    trust_remote_code: bool = False
    prompt_template: str = "{prompt}"
    use_chat_template: bool = False
    embedded: EmbeddedModelConfig = field(default_factory=EmbeddedModelConfig)

    def __post_init__(self) -> None:
        _one_of("model.source", self.source, ("embedded", "hf"))
        _one_of("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.path and self.source == "embedded":
            # Whoever names a model directory means to train it, not the built-in random model;
            # the runner says so in its log (run.train).
            self.source = "hf"
        if self.source == "hf":
            _check(bool(self.path), "model.path", self.path,
                   "must name a Hugging Face model id or a local directory when model.source=hf")
        _check("{prompt}" in self.prompt_template, "model.prompt_template", self.prompt_template,
               "must contain the placeholder {prompt}")


@dataclass
class SamplingConfig(Freezable):
    """How the engine samples rollouts. `n` is the GRPO group size (completions per prompt)."""

    name: str = "default"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = 0  # per-step seeds derive from it; null: unseeded sampling
    # batch: the engine's sampler is seeded once per step (one batched draw: the engine's full
    # speed; a prompt's samples depend on the batch it is in). prompt: every prompt seeded on its
    # own (vLLM then draws each request's noise separately, a kernel per request per token)
    seed_scope: str = "batch"
    logprobs: bool = True  # ask the engine for sampled-token log-probs (weight-sync health)
    # ask for them on steps 0, K, 2K... only (they cost the engine ~40 % of its tokens/s on the
    # H200); null: every step with trainer.tis_cap (its weights need them), else every 10th
    logprobs_every: Optional[int] = None
    ignore_eos: bool = False  # always generate max_tokens (benchmarks and soak tests)

    def __post_init__(self) -> None:
        _check(self.n >= 1, "sampling.n", self.n, "must be >= 1")
        _check(self.temperature >= 0, "sampling.temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, "sampling.top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "sampling.top_k", self.top_k, "must be -1 or >= 1")
        _check(self.max_tokens >= 1, "sampling.max_tokens", self.max_tokens, "must be >= 1")
        _one_of("sampling.seed_scope", self.seed_scope, ("batch", "prompt"))
        _check(all(isinstance(x, str) and x for x in self.stop), "sampling.stop", self.stop,
               "must hold non-empty strings (vLLM refuses an empty stop string)")
        _check(self.logprobs_every is None or self.logprobs_every >= 1, "sampling.logprobs_every",
               self.logprobs_every, "must be null (auto) or >= 1")
        if self.temperature == 0:
            _check(self.n == 1, "sampling.n", self.n,
                   "must be 1 when sampling.temperature=0 (greedy copies would be identical)")


@dataclass
class GeneratorConfig(Freezable):
    """The sleeping vLLM engine that runs in its own subprocess."""

    python: str = ""  # interpreter of the engine's environment; "" means this one
    device: str = "auto"  # auto | cuda | cpu
    # fraction of the GPU the engine may take while awake; auto: the start-up memory plan
    # (colo_rl.planner) gives it the KV cache of every sequence of a step, or what is left. A run's
    # default is auto (conf/generator/default.yaml); this class's 0.5 is for code that builds a
    # GeneratorConfig itself and starts an engine without a plan (benchmarks, tests)
    gpu_memory_utilization: Any = 0.5
    staging_dir: str = "auto"  # weight files for weight_sync=file; auto: /dev/shm when present
    max_model_len: int = 256
    max_num_seqs: int = 256
    enforce_eager: Optional[bool] = None  # null: CUDA graphs on GPU (2.5-3x faster), eager on CPU
    sleep_level: int = 2  # 2 discards weights (they are pushed every step); 1 keeps a CPU copy
    weight_sync: str = "auto"  # auto | file | cuda_ipc; auto: cuda_ipc on GPU, file on CPU
    cpu_kvcache_gib: int = 1  # KV cache size for vLLM on CPU (VLLM_CPU_KVCACHE_SPACE)
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    restart_on_failure: bool = False
    # Where vLLM's engine core runs. true: inside the worker process (one interpreter start instead
    # of three: 21 s instead of 56 s to start on 2 CPU cores). false: vLLM's own engine-core
    # subprocess, whose output processing overlaps the next forward (on the H200 its llm.generate
    # ran 1.23x faster, benchmarks/RESULTS.md). null: false on a GPU, true on CPU.
    in_process: Optional[bool] = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed through to vllm.LLM
    # vLLM's cache root (VLLM_CACHE_ROOT of the engine): its torch.compile artifacts and the
    # embedded model's files the engine reads, shared by every run and multirun job of the same
    # shape, so that only the first compiles. null: vLLM's own default, $VLLM_CACHE_ROOT or
    # ~/.cache/vllm; a path (e.g. on a file system every sweep job sees) instead.
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _one_of("generator.device", self.device, ("auto", "cuda", "cpu"))
        u = self.gpu_memory_utilization
        _check(u == "auto" or (isinstance(u, (int, float)) and not isinstance(u, bool) and 0 < u <= 1),
               "generator.gpu_memory_utilization", u, "must be in (0, 1] or auto")
        _one_of("generator.sleep_level", self.sleep_level, (1, 2))
        _one_of("generator.weight_sync", self.weight_sync, ("auto", "file", "cuda_ipc"))
        for key in ("max_model_len", "max_num_seqs"):
            _check(getattr(self, key) >= 1, f"generator.{key}", getattr(self, key), "must be >= 1")
        for key in ("start_timeout_s", "request_timeout_s", "cpu_kvcache_gib"):
            _check(getattr(self, key) > 0, f"generator.{key}", getattr(self, key), "must be > 0")
        if self.python:
            _check(os.access(self.python, os.X_OK), "generator.python", self.python,
                   "is not an executable file: give the interpreter of the environment that has vllm")


# Each optimizer and the package that provides it (None: torch itself).
OPTIMIZER_PACKAGES = {"adamw": None, "adamw_8bit": "bitsandbytes", "adamw_bf16_sr": "torchao"}
OPTIMIZERS = tuple(OPTIMIZER_PACKAGES)


@dataclass
class LoraConfig(Freezable):
    """LoRA adapters (peft) on the policy's linear layers; rank 0 trains every weight instead."""

    rank: int = 0  # 0: full fine-tuning
    # The update is (alpha / rank) * B @ A. A fixed alpha (not one that grows with the rank) keeps
    # the best learning rate about the same across ranks, as in "LoRA Without Regret" (alpha 32).
    alpha: float = 32.0
    dropout: float = 0.0  # on the adapter's input while training; the engine never sees it
    # Names (or dotted suffixes) of linear modules; empty: every linear layer of the decoder, not
    # the output head. A name that matches no linear layer is refused with the model's list.
    target_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "trainer.lora.rank", self.rank, "must be >= 0 (0: full fine-tuning)")
        _check(self.alpha > 0, "trainer.lora.alpha", self.alpha, "must be > 0")
        _check(0 <= self.dropout < 1, "trainer.lora.dropout", self.dropout, "must be in [0, 1)")


# conf/trainer/algo/'s presets (colo_rl.trainer.algorithms.ALGORITHMS)
ALGORITHM_PRESETS = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp")


@dataclass
class DynamicSamplingConfig(Freezable):
    """DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage, no gradient)
    are dropped, and the step's batch is filled from further prompts generated in the same wake."""

    enabled: bool = False
    max_rounds: int = 3  # generate calls per step at most, the first included (verl's max_num_gen_batches)

    def __post_init__(self) -> None:
        _check(self.max_rounds >= 1, "trainer.dynamic_sampling.max_rounds", self.max_rounds, "must be >= 1")


@dataclass
class TrainerConfig(Freezable):
    """GRPO: algorithm, optimisation and where the trainer state lives between phases."""

    # the preset (conf/trainer/algo/) the run's keys came from: a label in the run's config
    algorithm: str = "grpo"
    # named parts (colo_rl/trainer/algorithms.py): a built-in's short name or a module:function path
    advantage_estimator: str = "grpo"  # grpo | rloo | reinforce_pp | module:function
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo | module:function
    # TRL's mask_truncated_completions: completions that reached sampling.max_tokens (vLLM's
    # finish reason "length") are left out of the loss and its normalizer
    mask_truncated: bool = False
    # sequences of zero advantage skip forward and backward where the loss does not need them (no
    # KL term, a built-in policy loss, whose gradient there is 0); the normalizer stays the whole
    # batch's, so loss and gradients are unchanged but for summation order
    skip_zero_advantage: bool = False
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    device: str = "auto"  # auto | cuda | cpu
    steps: int = 30
    prompts_per_step: int = 8
    # sequences per forward/backward; gradients accumulate over them (the loss's normalizer is the
    # whole batch's, so the size changes results only by summation order). auto: the memory plan
    # picks the largest of AUTO_MICRO_BATCHES that fits on the GPU; DEFAULT_MICRO_BATCH elsewhere
    micro_batch_size: Any = "auto"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float = 1.0
    advantage_norm: str = "mean"  # mean (Dr. GRPO) | std (GRPO: divide by the group's std)
    loss_agg: str = "token"  # token | sequence | constant (Dr. GRPO: sum / (seqs x max_tokens))
    updates_per_batch: int = 1  # >1 reuses a batch with the PPO-clipped ratio
    clip_eps: float = 0.2
    # -- GRPO numerics (issue 19): advantage std, clip-higher, TIS, lr schedule, non-finite skips --
    # unbiased (Bessel) like TRL's GRPOTrainer and verl's GRPO advantage, so that runs compare
    # with theirs; population divides by n: advantages sqrt(n/(n-1)) times larger (1.07x at n=8)
    advantage_std: str = "unbiased"  # unbiased | population (only with advantage_norm=std)
    clip_eps_high: Optional[float] = None  # DAPO clip-higher: ratio clipped to [1-clip_eps, 1+this]; null: clip_eps
    # Truncated importance sampling (TRL's vllm_importance_sampling_correction, verl's TIS): each
    # token's loss times min(exp(trainer - engine log-prob), tis_cap); null: off
    tis_cap: Optional[float] = None
    # lr of step k (as transformers' get_*_schedule_with_warmup): linear warmup from 0 over
    # warmup_steps, then constant, or linear / cosine decay to 0 at trainer.steps
    lr_schedule: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    max_nonfinite_steps: int = 3  # a non-finite loss or grad norm skips the step; this many in a row stop the run
    kl_coef: float = 0.0  # >0 keeps a frozen reference policy and adds a k3 KL penalty
    # auto: `mixed` when model.dtype is bfloat16 or float16, else `pure`. mixed: fp32 master
    # weights and optimizer state, forward/backward autocast to model.dtype on a GPU (fp32 compute
    # on a CPU); the engine gets the masters cast to model.dtype at every push. pure: everything in
    # model.dtype; under bf16 an AdamW step of ~lr rounds away for most weights at lr 1e-6.
    precision: str = "auto"
    # Under trainer.precision=mixed on a GPU. true (TRL's default: torch autocast): the activations
    # between the matmuls (residual stream, norms, what backward keeps) stay fp32. false (verl's
    # FSDP and Megatron's default): the whole model computes in model.dtype from weight copies made
    # once per update, the gradients still summed into the fp32 masters: fewer bytes moved and
    # kept, at the rounding of a 16-bit residual stream.
    fp32_activations: bool = True
    # Under the weight copies of mixed precision on a GPU (not with DDP/FSDP, LoRA or compiled
    # layers): each linear layer's weight gradient is summed into the fp32 master gradient inside
    # its matmul (Megatron's gradient-accumulation fusion), not made in bf16 and added after: one
    # pass less over the weights per micro-batch, and no bf16 rounding of each micro-batch's part
    # (H100, 1B peer workload at micro-batch 32: train step 1.41 -> 1.39 s)
    fuse_grad_accumulation: bool = True
    # adamw: torch AdamW, state in the trainer's dtype. adamw_8bit: bitsandbytes' block-wise 8-bit
    # AdamW (2 bytes of state per parameter instead of 8). adamw_bf16_sr: torchao's AdamW with bf16
    # state and stochastic rounding of bf16 parameters (trainer.precision=pure, model.dtype=bfloat16).
    optimizer: str = "adamw"
    # Response positions per chunk of the output head in the log-prob forward: each chunk's logits
    # (chunk x vocab) are reduced to log-sum-exp and the sampled token's logit, and recomputed in
    # backward, so the (micro-batch x length x vocab) logits never exist; 0: the full logits
    logprob_chunk: int = 1024
    # auto | compiled | eager: how each chunk's logits become log-probs (the cast to fp32, the
    # temperature, log-sum-exp and the sampled token's logit; in backward the softmax gradient).
    # compiled: one torch.compile'd function (Inductor fuses them into a kernel or two that read the
    # head's bf16 logits, where eager runs each op as a pass over fp32 logits). auto: compiled on a
    # CUDA trainer, eager elsewhere (Inductor on a CPU needs a C++ compiler and compiles slowly)
    logprob_kernel: str = "auto"
    # The output head (a plain bias-free linear layer) and the chunks' log-softmax as one autograd
    # function (colo_rl/trainer/head.py): the head's weight cast once per micro-batch, not in every
    # chunk and its recomputation, and its gradient summed over the chunks in fp32 inside the
    # matmuls on CUDA; same values. false: each chunk through the head module under activation
    # checkpointing (a LoRA-adapted or otherwise wrapped head always goes that way)
    fused_head: bool = True
    # With the fused head: true recomputes each chunk's logits in backward; false keeps them from
    # forward (micro-batch x max_tokens x vocab in model.dtype at the peak, 1.6 GiB for the 1B peer
    # workload at micro-batch 32) and saves one head matmul per chunk (H100: 1.46 -> 1.41 s a train
    # step). auto: the memory plan keeps them where they fit beside the chosen micro-batch (after
    # it: a larger micro-batch gains more); true where nothing is planned (a CPU, trainer.parallel)
    logprob_recompute: Any = "auto"
    # Sequences go into micro-batches in order of length, so each pads to a length near its own
    # (same loss and gradients up to float summation order); false: in batch order
    sort_by_length: bool = True
    # Dense bf16 peak of the training device in TFLOP/s, for perf/mfu; null: NVIDIA's figure for a
    # known GPU (H100/H200 989, A100 312; colo_rl/trainer/flops.py), none logged on a CPU or other GPU
    peak_tflops: Optional[float] = None
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~1.3x the compute
    # auto | none | liger: Liger's fused Triton kernels for RMSNorm, SwiGLU and RoPE (a CUDA
    # trainer, liger-kernel installed, a model type it knows); same computation, fewer passes
    # over the activations (H100, 1B peer workload: train step 3.19 -> 2.24 s). auto: liger
    # wherever it can run (not with trainer.compile), else none
    kernels: str = "auto"
    # torch.compile each decoder layer (regional: compiled once, reused by every layer); the first
    # train step pays the compilation
    compile: bool = False
    # auto | all | optimizer | none: what leaves the GPU while the engine is awake. auto: the
    # start-up memory plan (colo_rl.planner) keeps on the GPU whatever fits beside the awake engine
    # (on a CPU: all, as the CPU path always did)
    offload: str = "auto"
    overlap_restore: bool = True  # CUDA: AdamW state comes back on a side stream, under the next step's work
    # Restore before the engine sleeps when the GPU has room for both (checked every step): the
    # copies then run before the engine frees its memory, not in the contended second after
    # (H200, 1B shape: the restore waited for 0.086 s instead of 0.143 s, switch 0.551 s not 0.664 s).
    restore_while_awake: bool = True
    # Keep torch's allocator cache (about the train step's peak) while the engine is awake, where
    # the plan finds room for both: saves emptying it and allocating it again next step (0.046 s of
    # the H200's 0.40 s switch), at the price of a device peak of trainer peak + awake engine
    # (H100 peer run: 69.2 GiB against TRL's 59.1). Off by default: the memory is the scarcer.
    keep_cache: bool = False
    seed: int = 0
    checkpoint_every: int = 0  # steps; 0: only at the end and on interruption
    checkpoint_final: bool = True  # false: none at the end (a sweep that wants metrics only); faults still write one
    # true: periodic and final checkpoints are copied to host memory (the step waits for that copy
    # only) and written on a thread while the run goes on; needs host memory for one more copy of
    # the trainer's state (1B shape, fp32 masters + AdamW: 16.6 GiB)
    checkpoint_background: bool = False
    resume: Optional[str] = None  # a checkpoint directory written by an earlier run
    export_final: bool = False  # at the end, a Hugging Face model directory from the last checkpoint
    export_dir: Optional[str] = None  # where export_final writes; null: OUTPUT_DIR/export
    parallel: str = "none"  # none | ddp | fsdp: data parallel over torchrun's ranks (one GPU each)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _one_of("trainer.algorithm", self.algorithm, ALGORITHM_PRESETS)
        _one_of("trainer.device", self.device, ("auto", "cuda", "cpu"))
        _one_of("trainer.advantage_norm", self.advantage_norm, ("mean", "std"))
        _one_of("trainer.loss_agg", self.loss_agg, ("token", "sequence", "constant"))
        _one_of("trainer.offload", self.offload, ("auto", "all", "optimizer", "none"))
        _one_of("trainer.precision", self.precision, ("auto", "mixed", "pure"))
        _one_of("trainer.optimizer", self.optimizer, OPTIMIZERS)
        _one_of("trainer.parallel", self.parallel, ("none", "ddp", "fsdp"))
        _one_of("trainer.kernels", self.kernels, ("auto", "none", "liger"))
        _check(not (self.kernels == "liger" and self.compile), "trainer.kernels", self.kernels,
               "cannot be combined with trainer.compile=true: Dynamo does not trace Liger's Triton "
               "kernels (on an H100 the compiled Liger model's log-probs differed from the same model "
               "run eagerly by up to 1.2); set trainer.kernels=auto (it leaves Liger off when compiling) or "
               "trainer.compile=false")
        if self.parallel == "fsdp":
            if self.offload == "auto":
                self.offload = "none"
            _check(self.offload == "none", "trainer.offload", self.offload,
                   "must be none with trainer.parallel=fsdp (the shards stay on their GPUs; "
                   "use trainer.parallel=ddp to offload)")
            _check(self.kl_coef == 0, "trainer.kl_coef", self.kl_coef,
                   "must be 0 with trainer.parallel=fsdp (no sharded reference model yet)")
            _check(self.resume is None, "trainer.resume", self.resume,
                   "is not supported with trainer.parallel=fsdp yet: resume with trainer.parallel=ddp")
            _check(self.lora.rank == 0, "trainer.lora.rank", self.lora.rank,
                   "must be 0 with trainer.parallel=fsdp (the merged push does not gather sharded "
                   "adapters yet): use trainer.parallel=ddp with LoRA")
        _check(self.peak_tflops is None or self.peak_tflops > 0, "trainer.peak_tflops", self.peak_tflops,
               "must be null (the device's known peak) or > 0 (TFLOP/s)")
        _one_of("trainer.logprob_kernel", self.logprob_kernel, ("auto", "compiled", "eager"))
        _check(self.logprob_chunk >= 0, "trainer.logprob_chunk", self.logprob_chunk,
               "must be >= 0 (response positions per chunk of the output head; 0: full logits)")
        for key in ("steps", "prompts_per_step", "updates_per_batch"):
            _check(getattr(self, key) >= 1, f"trainer.{key}", getattr(self, key), "must be >= 1")
        m = self.micro_batch_size
        _check(m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m >= 1),
               "trainer.micro_batch_size", m, "must be >= 1 or auto")
        _check(self.logprob_recompute == "auto" or isinstance(self.logprob_recompute, bool),
               "trainer.logprob_recompute", self.logprob_recompute, "must be true, false or auto")
        _check(self.lr > 0, "trainer.lr", self.lr, "must be > 0")
        _check(self.weight_decay >= 0, "trainer.weight_decay", self.weight_decay, "must be >= 0")
        _check(self.max_grad_norm > 0, "trainer.max_grad_norm", self.max_grad_norm, "must be > 0")
        _check(0 < self.clip_eps < 1, "trainer.clip_eps", self.clip_eps, "must be in (0, 1)")
        _one_of("trainer.advantage_std", self.advantage_std, ("unbiased", "population"))
        _check(self.clip_eps_high is None or self.clip_eps_high > 0, "trainer.clip_eps_high",
               self.clip_eps_high, "must be null (= trainer.clip_eps) or > 0")
        _check(self.tis_cap is None or self.tis_cap > 0, "trainer.tis_cap", self.tis_cap,
               "must be null (off) or > 0 (e.g. 2.0)")
        _one_of("trainer.lr_schedule", self.lr_schedule, ("constant", "linear", "cosine"))
        _check(0 <= self.warmup_steps < self.steps, "trainer.warmup_steps", self.warmup_steps,
               f"must be in [0, trainer.steps={self.steps}) (the lr reaches trainer.lr after them)")
        _check(self.max_nonfinite_steps >= 1, "trainer.max_nonfinite_steps", self.max_nonfinite_steps,
               "must be >= 1")
        _check(self.kl_coef >= 0, "trainer.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.checkpoint_every >= 0, "trainer.checkpoint_every", self.checkpoint_every, "must be >= 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "trainer.betas",
               self.betas, "must be two numbers in [0, 1)")
        if self.export_final:
            _check(self.checkpoint_final, "trainer.checkpoint_final", self.checkpoint_final,
                   "but trainer.export_final=true exports the final checkpoint: set one of them right")
        if self.export_dir is not None:
            _check(self.export_final, "trainer.export_dir", self.export_dir,
                   "is set but trainer.export_final=false: add trainer.export_final=true")
            _check(not os.path.isfile(self.export_dir), "trainer.export_dir", self.export_dir,
                   "is a file: give a directory for the exported model")
        if self.resume is not None:
            _check(os.path.isfile(os.path.join(self.resume, "manifest.json")), "trainer.resume",
                   self.resume, "is not a checkpoint directory (no manifest.json in it): point it "
                   "at the checkpoint/ directory of an earlier run")


@dataclass
class ToyConfig(Freezable):
    """The built-in toy tasks' prompts: random strings over `alphabet`, generated from task.seed."""

    target: str = "a"  # target_char: the character to emit
    prompt_len: int = 4  # random characters per prompt
    alphabet: str = "abcdefghijklmnopqrstuvwxyz"

    def __post_init__(self) -> None:
        _check(len(self.target) == 1, "task.toy.target", self.target, "must be one character")
        _check(self.prompt_len >= 1, "task.toy.prompt_len", self.prompt_len, "must be >= 1")
        _check(len(self.alphabet) >= 1, "task.toy.alphabet", self.alphabet,
               "must hold at least one character (prompts are drawn from it)")


@dataclass
class DatasetConfig(Freezable):
    """A Hugging Face dataset read offline: a local JSON/JSONL/CSV/Parquet file, a save_to_disk
    directory, or a hub dataset id already in the local cache."""

    path: Optional[str] = None
    split: str = "train"  # slices work for files and hub data: train[:90%]
    eval_split: Optional[str] = None  # held-out prompts; null: eval.size rows held out of `split`
    prompt_column: Optional[str] = "prompt"  # plain text, wrapped by model.prompt_template
    messages_column: Optional[str] = None  # chat format [{role, content}, ...]; replaces prompt_column
    reward_columns: Optional[list[str]] = None  # passed to the reward functions; null: all other columns

    def __post_init__(self) -> None:
        _check(bool(self.prompt_column) or bool(self.messages_column), "task.dataset.prompt_column",
               self.prompt_column, "or task.dataset.messages_column must name the column prompts are in")


@dataclass
class TaskConfig(Freezable):
    """Where prompts come from and how completions are scored."""

    name: str = "target_char"
    kind: str = "target_char"  # target_char | copy (built-in toys) | dataset (task.dataset)
    # reward functions by import path (module:function) or built-in name; their weighted sum is
    # the GRPO reward
    rewards: list[str] = field(default_factory=lambda: ["target_char"])
    reward_weights: list[float] = field(default_factory=list)  # one per reward; empty: all 1
    # DAPO's soft overlong punishment (the built-in reward `overlong`, added to task.rewards when > 0):
    # the last this share of sampling.max_tokens costs up to task.overlong_penalty (DAPO: 0.2, 1.0)
    overlong_buffer: float = 0.0
    overlong_penalty: float = 1.0
    # seconds one reward function's call may take on one batch; past it the run stops naming the
    # function, with a checkpoint of the steps done (a function that never returns would hang it)
    reward_timeout_s: float = 600.0
    # longer prompts are skipped (counted and logged); null: generator.max_model_len - sampling.max_tokens
    max_prompt_tokens: Optional[int] = None
    seed: int = 0  # the order prompts are drawn in (shuffled epochs), and the toys' rows
    toy: ToyConfig = field(default_factory=ToyConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)

    def __post_init__(self) -> None:
        _one_of("task.kind", self.kind, ("target_char", "copy", "dataset"))
        _check(len(self.rewards) >= 1, "task.rewards", self.rewards,
               "must name at least one reward function (module:function)")
        _check(0 <= self.overlong_buffer <= 1, "task.overlong_buffer", self.overlong_buffer,
               "must be in [0, 1] (a share of sampling.max_tokens; 0: off)")
        _check(not self.reward_weights or len(self.reward_weights) == len(self.rewards),
               "task.reward_weights", self.reward_weights,
               f"must give one weight per task.rewards entry ({len(self.rewards)}), or be empty")
        _check(self.reward_timeout_s > 0, "task.reward_timeout_s", self.reward_timeout_s, "must be > 0")
        if self.max_prompt_tokens is not None:
            _check(self.max_prompt_tokens >= 1, "task.max_prompt_tokens", self.max_prompt_tokens,
                   "must be >= 1 (or null)")
        if self.kind == "dataset":
            _check(bool(self.dataset.path), "task.dataset.path", self.dataset.path,
                   "must name a local file, a save_to_disk directory or a cached hub dataset "
                   "for task.kind=dataset")


@dataclass
class EvalConfig(Freezable):
    """Held-out evaluation through the same engine: before the first step, every `every` steps
    (in the same wake as that step's rollouts) and after the last."""

    every: int = 10  # steps; 0: no evaluation
    size: int = 32  # held-out prompts per evaluation (the first of the held-out set)
    n: int = 1  # completions per prompt: eval/pass_at_<n>
    temperature: float = 0.0  # greedy by default
    pass_reward: float = 1.0  # a completion passes when its reward is at least this

    def __post_init__(self) -> None:
        _check(self.every >= 0, "eval.every", self.every, "must be >= 0 (0: no evaluation)")
        _check(self.size >= 1, "eval.size", self.size, "must be >= 1")
        _check(self.n >= 1, "eval.n", self.n, "must be >= 1")
        _check(self.temperature >= 0, "eval.temperature", self.temperature, "must be >= 0")
        if self.temperature == 0:
            _check(self.n == 1, "eval.n", self.n,
                   "must be 1 with eval.temperature=0 (greedy copies would be identical)")


@dataclass
class LoggerConfig(Freezable):
    """Where metrics go besides metrics.jsonl (always written)."""

    backend: str = "wandb"  # wandb | none
    mode: str = "auto"  # auto (online when an API key is configured, else offline) | online | offline | disabled
    project: str = "colo_rl"
    entity: Optional[str] = None
    group: Optional[str] = None  # default in multirun: the sweep directory
    name: Optional[str] = None  # default in multirun: the job's overrides
    tags: list[str] = field(default_factory=list)
    progress: bool = True  # one progress bar over steps
    log_completions: int = 8  # first completions of each step to samples.jsonl and a W&B table

    def __post_init__(self) -> None:
        _one_of("logger.backend", self.backend, ("wandb", "none"))
        _one_of("logger.mode", self.mode, ("auto", "online", "offline", "disabled"))
        _check(self.log_completions >= 0, "logger.log_completions", self.log_completions, "must be >= 0")


@dataclass
class RunConfig(Freezable):
    """The root config: one of each group plus run-wide settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    output_dir: Optional[str] = None  # default: Hydra's runtime.output_dir
    # true: a run without trainer.resume into a directory holding an earlier run's checkpoint
    # replaces it (and drops its metrics); false: such a run is refused
    overwrite_output_dir: bool = False
    debug: bool = False  # true: input errors show their traceback too (colo_rl.cli)


def package_dir(name: str) -> Path:
    """`conf` or `experiments`: inside the installed package (a wheel ships them as colo_rl/conf
    and colo_rl/experiments), else at the top of the source tree, beside colo_rl/."""
    package = Path(__file__).resolve().parent
    inside = package / name
    return inside if inside.is_dir() else package.parent / name


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore and into OmegaConf the resolvers `colo_rl.dir` (which
    conf/run.yaml's search path uses) and `colo_rl.flat` (conf/hydra's sweep subdir); idempotent."""
    ConfigStore.instance().store(name="colo_rl_schema", node=RunConfig)
    if not OmegaConf.has_resolver("colo_rl.dir"):
        OmegaConf.register_new_resolver("colo_rl.dir", lambda name: package_dir(name).as_uri())
    if not OmegaConf.has_resolver("colo_rl.flat"):
        # a sweep job's directory name from its overrides: a group override (trainer/algo=gspo)
        # would otherwise nest it in a directory named after the overrides before the slash
        OmegaConf.register_new_resolver("colo_rl.flat", lambda text: text.replace("/", "."))


def validate(cfg: DictConfig | RunConfig) -> RunConfig:
    """Check the whole config and return it as typed objects; raises ConfigError naming the key.

    Runs before any engine starts or any tensor is touched.
    """
    if isinstance(cfg, RunConfig):
        settings = cfg
    else:
        _refuse_added_keys(cfg)
        try:
            settings = OmegaConf.to_object(cfg)
        except ConfigError:
            raise
        except MissingMandatoryValue as exc:
            raise ConfigError(f"{exc.full_key}: has no value (??? in its YAML) and must be set: "
                              f"add {exc.full_key}=VALUE to the command line") from None
        except Exception as exc:  # omegaconf wraps __post_init__ errors; unwrap ours
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, ConfigError):
                raise cause from None
            raise
    _check_finite(settings)
    s, g, t = settings.sampling, settings.generator, settings.trainer
    if t.advantage_norm == "std":
        _check(s.n >= 2, "sampling.n", s.n,
               "must be >= 2 with trainer.advantage_norm=std (a group of one has no std); "
               "use trainer.advantage_norm=mean or a larger group")
    if t.tis_cap is not None:
        _check(s.logprobs, "sampling.logprobs", s.logprobs,
               f"must be true with trainer.tis_cap={t.tis_cap} (the importance weights need the "
               "engine's sampled log-probs); set sampling.logprobs=true or trainer.tis_cap=null")
        _check(s.logprobs_every in (None, 1), "sampling.logprobs_every", s.logprobs_every,
               f"must be 1 or null with trainer.tis_cap={t.tis_cap} (the importance weights need the "
               "engine's log-probs on every step); set sampling.logprobs_every=null or trainer.tis_cap=null")
        mode = g.engine_kwargs.get("logprobs_mode", "processed_logprobs")
        _check(s.temperature == 1 or mode == "processed_logprobs", "sampling.temperature", s.temperature,
               f"needs generator.engine_kwargs.logprobs_mode=processed_logprobs (colo_rl's default) with "
               f"trainer.tis_cap={t.tis_cap}: {mode!r} are log-probs before the temperature, the "
               "trainer's after it, so their ratio would not be the sampling mismatch")
    if s.max_tokens >= g.max_model_len:
        raise ConfigError(f"sampling.max_tokens={s.max_tokens} must be below generator.max_model_len="
                          f"{g.max_model_len} (prompt and completion share it)")
    p = settings.task.max_prompt_tokens
    if p is not None and p + s.max_tokens > g.max_model_len:
        raise ConfigError(f"task.max_prompt_tokens={p} + sampling.max_tokens={s.max_tokens} exceed "
                          f"generator.max_model_len={g.max_model_len}: the engine would cut completions "
                          f"short; lower one or raise generator.max_model_len")
    if g.device == "cpu" and g.weight_sync == "cuda_ipc":
        raise ConfigError("generator.weight_sync=cuda_ipc needs a CUDA GPU but generator.device=cpu: "
                          "use generator.weight_sync=file")
    if t.device == "cpu" and g.weight_sync == "cuda_ipc":
        raise ConfigError("generator.weight_sync=cuda_ipc shares the trainer's GPU tensors but "
                          "trainer.device=cpu: use generator.weight_sync=file")
    _check_precision(settings)
    for key, requested in (("trainer.device", t.device), ("generator.device", g.device)):
        if requested == "cuda" and resolve_device("auto") != "cuda":
            raise ConfigError(f"{key}=cuda, but torch sees no CUDA GPU on this machine: use "
                              f"{key}=auto (or cpu)")
    if g.python:
        check_engine_python(g.python)
    return settings


def _refuse_added_keys(cfg: DictConfig) -> None:
    """A key the schema does not have, added with `+key=value` (Hydra lets `+` past the schema),
    would be stored and ignored: refused, naming it. Free-form dicts (generator.engine_kwargs)
    take any key."""
    for key in _added_keys(cfg, ""):
        raise ConfigError(f"{key}: no such key in colo_rl's config, so it would be ignored. Check its "
                          "spelling against `python -m colo_rl.run --cfg job` (a key is set as "
                          "group.key=VALUE, without +)")


def _added_keys(node: DictConfig, prefix: str):
    import dataclasses

    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields:
            yield f"{prefix}{key}"
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            yield from _added_keys(child, f"{prefix}{key}.")


def _check_finite(obj: Any, prefix: str = "") -> None:
    """Every float of the config (and of its lists) is finite: an inf or NaN passes every range
    check written as a comparison (inf > 0), and would reach the engine or the optimizer."""
    import dataclasses
    import math

    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{key}.")
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"{key}{'' if i is None else f'[{i}]'}={item} must be a finite number")


def trainer_precision(settings: RunConfig) -> str:
    """trainer.precision with `auto` resolved: fp32 masters whenever the engine's dtype is 16-bit."""
    if settings.trainer.precision != "auto":
        return settings.trainer.precision
    return "mixed" if settings.model.dtype in ("bfloat16", "float16") else "pure"


# trainer.micro_batch_size=auto: the memory plan takes the largest of these whose activations fit
# beside the sleeping engine (32 was the fastest measured on the 1B peer workload, H100:
# benchmarks/RESULTS.md 2026-12-06e/f); DEFAULT_MICRO_BATCH where nothing is planned (a CPU run,
# a model the planner cannot read) and under trainer.parallel, whose ranks must agree on it
AUTO_MICRO_BATCHES = (32, 16, 8, 4, 2, 1)
DEFAULT_MICRO_BATCH = 16


def micro_batch_size(t: "TrainerConfig") -> int:
    """trainer.micro_batch_size as a number: auto left unresolved (no memory plan) is DEFAULT_MICRO_BATCH."""
    return DEFAULT_MICRO_BATCH if t.micro_batch_size == "auto" else t.micro_batch_size


def logprob_recompute(t: "TrainerConfig") -> bool:
    """trainer.logprob_recompute as a bool: auto left unresolved (no memory plan) recomputes."""
    return True if t.logprob_recompute == "auto" else bool(t.logprob_recompute)


def trainer_dtype(settings: RunConfig) -> str:
    """The dtype of the trainer's parameters and optimizer state."""
    return "float32" if trainer_precision(settings) == "mixed" else settings.model.dtype


def _check_precision(settings: RunConfig) -> None:
    import importlib.util

    t = settings.trainer
    if t.lora.rank and importlib.util.find_spec("peft") is None:
        raise ConfigError(f"trainer.lora.rank={t.lora.rank} needs the package peft, which is not installed "
                          "here: pip install 'colo_rl[lora]', or set trainer.lora.rank=0")
    package = OPTIMIZER_PACKAGES[t.optimizer]
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"trainer.optimizer={t.optimizer} needs the package {package}, which is not "
                          f"installed here: pip install {package}, or use trainer.optimizer=adamw")
    if t.optimizer == "adamw_bf16_sr" and not (settings.model.dtype == "bfloat16"
                                               and trainer_precision(settings) == "pure"):
        raise ConfigError(f"trainer.optimizer=adamw_bf16_sr rounds bf16 parameters stochastically, but "
                          f"model.dtype={settings.model.dtype} and trainer.precision={t.precision}: set "
                          "model.dtype=bfloat16 trainer.precision=pure, or use trainer.optimizer=adamw")
    if t.optimizer == "adamw_8bit" and t.parallel == "fsdp":
        raise ConfigError("trainer.optimizer=adamw_8bit does not take FSDP's sharded parameters: use "
                          "trainer.optimizer=adamw with trainer.parallel=fsdp")


ENGINE_MODULES = ("vllm", "torch", "safetensors", "psutil", "hydra", "omegaconf")
PIP_NAMES = {"hydra": "hydra-core"}
PROBE_TIMEOUT_S = 30.0


def check_engine_python(python: str) -> None:
    """generator.python must be a Python that can run colo_rl's engine worker: asked, in a few
    milliseconds, which of the modules the worker imports it cannot find (nothing is imported)."""
    import json
    import subprocess

    probe = ("import importlib.util, json; print(json.dumps([m for m in %r "
             "if importlib.util.find_spec(m) is None]))" % (ENGINE_MODULES,))
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        missing = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"generator.python={python} did not answer a {PROBE_TIMEOUT_S:.0f} s "
                          "probe (python -c 'import importlib.util ...'): give the interpreter of "
                          "the environment that has vllm") from None
    except (OSError, ValueError, IndexError):
        missing = None
    if missing is None:
        raise ConfigError(f"generator.python={python} is not a Python interpreter that runs "
                          "`-c CODE`: give the interpreter of the environment that has vllm "
                          "(e.g. /path/to/venv/bin/python)")
    if missing:
        packages = " ".join(PIP_NAMES.get(m, m) for m in missing)
        raise ConfigError(f"generator.python={python} cannot import {', '.join(missing)}, which "
                          f"colo_rl's engine worker needs: install them there (`{python} -m pip "
                          f"install {packages}`), or point generator.python at an environment "
                          "that has them")


def resolve_device(requested: str) -> str:
    """`auto` means CUDA when this process can see a GPU."""
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_python(g: GeneratorConfig) -> str:
    return g.python or sys.executable
