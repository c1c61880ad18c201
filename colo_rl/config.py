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
from dataclasses import MISSING, FrozenInstanceError, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional

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


def described(default: Any = MISSING, help: str = "", *, factory: Optional[Callable[[], Any]] = None,
              type_name: Optional[str] = None) -> Any:
    """A config key's dataclass field with its one description, `help` (what it does, its unit, its
    trade-off): docs/config.md is generated from it (colo_rl.docs). `factory` for a mutable default;
    `type_name` for the reference where the annotation (Any) cannot say what the key takes."""
    metadata = {"help": help, **({"type": type_name} if type_name else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class EmbeddedModelConfig(Freezable):
    """Shape of a randomly initialised OLMo-2 policy built locally (no hub needed)."""

    hidden_size: int = described(128, "Width of the residual stream.")
    intermediate_size: int = described(256, "Width of each decoder layer's MLP.")
    num_hidden_layers: int = described(2, "Decoder layers.")
    num_attention_heads: int = described(2, "Attention heads; must divide hidden_size.")
    num_key_value_heads: int = described(2, "Key/value heads (grouped-query attention); must divide "
                                         "num_attention_heads.")
    vocab_size: int = described(64, "Vocabulary size; a character-level tokenizer is built to exactly "
                                "this size.")
    max_position_embeddings: int = described(512, "Longest sequence (prompt + completion) the model "
                                             "accepts, in tokens.")
    init_seed: int = described(0, "Seed of the random initialisation: the same seed gives the same "
                               "weights on the same kind of device.")

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

    name: str = described("tiny", "A label for the model in the run's config and W&B.")
    source: str = described("embedded", "embedded: build model.embedded locally with random weights; hf: "
                            "model.path is a Hugging Face id (looked up in the local cache only) or a "
                            "local directory. Setting model.path switches it to hf.")
    path: Optional[str] = described(None, "Hugging Face model id or local directory (model.source=hf).")
    tokenizer: Optional[str] = described(None, "Tokenizer id or directory; null: the same as model.path.")
    dtype: str = described("float32", "float32 | bfloat16 | float16: what the engine serves and an export "
                           "writes by default. The trainer's own precision is trainer.memory.precision (fp32 "
                           "master weights by default under bf16/fp16).")
    trust_remote_code: bool = described(False, "Run the model repository's own Python code (transformers' "
                                        "and vLLM's trust_remote_code).")
    prompt_template: str = described("{prompt}", "Wraps each prompt; must contain {prompt}.")
    use_chat_template: bool = described(False, "Put each prompt through the tokenizer's chat template as a "
                                        "user message (after prompt_template).")
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

    name: str = described("default", "A label for the sampling preset in the run's config.")
    n: int = described(8, "GRPO group size: completions per prompt.")
    temperature: float = described(1.0, "Sampling temperature; 0: greedy (then n must be 1).")
    top_p: float = described(1.0, "Nucleus sampling: the smallest set of tokens with this much "
                             "probability; 1: off.")
    top_k: int = described(-1, "Sample from the k most likely tokens; -1: no top-k.")
    max_tokens: int = described(16, "Longest completion, in tokens; must leave room for the prompt in "
                                "generator.max_model_len.")
    stop: list[str] = described(help="Strings that end a completion (not included in it).", factory=list)
    seed: Optional[int] = described(0, "Per-step sampling seeds derive from it; null: unseeded sampling.")
    seed_scope: str = described("batch", "batch: the engine's sampler is seeded once per step (one batched "
                                "draw at the engine's full speed; a prompt's samples depend on the batch "
                                "it is in). prompt: every prompt seeded on its own (batch-independent, but "
                                "vLLM then draws each request's noise separately, a kernel per request per "
                                "token).")
    logprobs: bool = described(True, "Ask the engine for the sampled tokens' log-probs: the weight-sync "
                               "health metric train/engine_logprob_gap and trainer.algo.tis_cap need them.")
    logprobs_every: Optional[int] = described(None, "Ask for log-probs on steps 0, K, 2K... only (they "
                                              "cost the engine a large share of its throughput); null: "
                                              "every step with trainer.algo.tis_cap (its weights need them), "
                                              "else every 10th.")
    ignore_eos: bool = described(False, "Always generate max_tokens, ignoring end-of-sequence (benchmarks "
                                 "and soak tests).")

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

    python: str = described("", "Interpreter of the engine's environment (one that has vllm); \"\": this one.")
    device: str = described("auto", "auto | cuda | cpu: where the engine runs; auto: CUDA when torch sees "
                            "a GPU.")
    gpu_memory_utilization: Any = described(0.5, type_name="float or auto", help=(
        "Fraction of the GPU the engine may take while awake (the trainer gets it back while it "
        "sleeps), in (0, 1], or auto: the start-up memory plan (colo_rl.planner) gives it the KV "
        "cache of every sequence of a step, or what is left. A run's default is auto "
        "(conf/generator/default.yaml); the schema's 0.5 is for code that builds a "
        "GeneratorConfig and starts an engine without a plan (benchmarks, tests)."))
    staging_dir: str = described("auto", "Where weight files go for weight_sync=file; auto: /dev/shm (RAM) "
                                 "when present.")
    max_model_len: int = described(256, "Longest sequence (prompt + completion) the engine serves, in tokens.")
    max_num_seqs: int = described(256, "Sequences the engine runs at once (vLLM's max_num_seqs).")
    enforce_eager: Optional[bool] = described(None, "true: no CUDA graphs (faster start, slower "
                                              "generation); null: CUDA graphs on a GPU, eager on CPU.")
    sleep_level: int = described(2, "vLLM's sleep level: 2 discards the weights while asleep (they are "
                                 "pushed every step anyway); 1 keeps a CPU copy of them.")
    weight_sync: str = described("auto", "auto | file | cuda_ipc: how the trainer's weights reach the "
                                 "engine; auto: cuda_ipc on a GPU (no host copy), file on CPU.")
    cpu_kvcache_gib: int = described(1, "KV cache size of vLLM on CPU, in GiB (VLLM_CPU_KVCACHE_SPACE).")
    start_timeout_s: float = described(600.0, "Seconds the engine may take to start before it is killed.")
    request_timeout_s: float = described(600.0, "Seconds one request (generate, weight load, sleep) may "
                                         "take before the engine is killed.")
    restart_on_failure: bool = described(False, "true: a step whose engine failed starts a fresh engine "
                                         "and retries once; false: the run stops with a checkpoint.")
    in_process: Optional[bool] = described(None, "Where vLLM's engine core runs. true: inside the worker "
                                           "process (one interpreter start instead of three: a faster "
                                           "start). false: vLLM's own engine-core subprocess, whose output "
                                           "processing overlaps the next forward (faster generation). "
                                           "null: false on a GPU, true on CPU.")
    engine_kwargs: dict[str, Any] = described(help="Passed to vllm.LLM as they are; each added with a +, "
                                              "e.g. '+generator.engine_kwargs.compilation_config="
                                              "{cudagraph_mode: FULL_DECODE_ONLY}' (less memory asleep, "
                                              "slightly slower generation).", factory=dict)
    cache_dir: Optional[str] = described(None, "vLLM's cache root (VLLM_CACHE_ROOT of the engine): its "
                                         "torch.compile artifacts and the embedded model's files, shared "
                                         "by every run and sweep job of the same shape so that only the "
                                         "first compiles; null: $VLLM_CACHE_ROOT or ~/.cache/vllm.")

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

    rank: int = described(0, "LoRA rank; 0: full fine-tuning. With a rank only the adapters train (they "
                          "want a larger lr than full fine-tuning).")
    alpha: float = described(32.0, "The update is (alpha / rank) * B @ A. A fixed alpha (not one that "
                             "grows with the rank) keeps the best learning rate about the same across "
                             "ranks, as in \"LoRA Without Regret\".")
    dropout: float = described(0.0, "Dropout on the adapters' input in training forwards, in [0, 1); the "
                               "engine never sees it.")
    target_modules: list[str] = described(help="Names (or dotted suffixes) of linear modules, e.g. [q_proj, "
                                          "v_proj]; empty: every linear layer of the decoder, not the "
                                          "output head. A name that matches no linear layer is refused "
                                          "with the model's list.", factory=list)

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

    enabled: bool = described(False, "Drop groups of equal rewards and fill the batch from further "
                              "prompts (DAPO's dynamic sampling).")
    max_rounds: int = described(3, "Generate calls per step at most, the first included (verl's "
                                "max_num_gen_batches); a step still short of groups after them is topped up with "
                                "dropped ones.")

    def __post_init__(self) -> None:
        _check(self.max_rounds >= 1, "trainer.algo.dynamic_sampling.max_rounds", self.max_rounds,
               "must be >= 1")


@dataclass
class AlgoConfig(Freezable):
    """The RL algorithm: how rewards become advantages and the policy loss. A preset of conf/trainer/algo/
    (trainer/algo=dapo) sets these together."""

    name: str = described("grpo", "The preset (conf/trainer/algo/) the run's algorithm keys came from: "
                          "a label in the run's config.")
    advantage_estimator: str = described("grpo", "grpo | rloo | reinforce_pp | module:function: how rewards "
                                         "become advantages (colo_rl/trainer/algorithms.py).")
    advantage_norm: str = described("mean", "mean: reward minus the group's mean (Dr. GRPO) | std: also "
                                    "divided by the group's std (GRPO).")
    advantage_std: str = described("unbiased", "unbiased | population: the group std of "
                                   "advantage_norm=std. unbiased (Bessel) is TRL's GRPOTrainer's and verl's, "
                                   "so runs compare with theirs; population divides by n, giving "
                                   "advantages sqrt(n/(n-1)) times larger.")
    policy_loss: str = described("ppo_clip", "ppo_clip | gspo | module:function: the per-token policy loss "
                                 "(colo_rl/trainer/algorithms.py).")
    loss_agg: str = described("token", "token: mean over all tokens of the batch | sequence: mean of each "
                              "sequence's token mean | constant: sum / (sequences x max_tokens) (Dr. GRPO, "
                              "no length bias).")
    clip_eps: float = described(0.2, "PPO clip: the ratio is clipped to [1 - clip_eps, 1 + clip_eps].")
    clip_eps_high: Optional[float] = described(None, "DAPO's clip-higher: the ratio is clipped to "
                                               "[1 - clip_eps, 1 + clip_eps_high]; null: clip_eps.")
    tis_cap: Optional[float] = described(None, "Truncated importance sampling of the engine/trainer mismatch "
                                         "(TRL's vllm_importance_sampling_correction, verl's TIS): each "
                                         "token's loss times min(exp(trainer - engine log-prob), tis_cap); "
                                         "null: off. Needs the engine's log-probs on every step.")
    kl_coef: float = described(0.0, "> 0 keeps a frozen reference copy of the policy (its memory) and adds "
                               "a k3 KL penalty of this weight.")
    updates_per_batch: int = described(1, "Optimizer updates per batch; > 1 reuses the batch with the "
                                       "PPO-clipped ratio.")
    mask_truncated: bool = described(False, "Leave completions that reached sampling.max_tokens (vLLM's "
                                     "finish reason \"length\") out of the loss and its normalizer (TRL's "
                                     "mask_truncated_completions).")
    skip_zero_advantage: bool = described(False, "Sequences of zero advantage skip forward and backward "
                                          "where the loss does not need them (no KL term, a built-in policy "
                                          "loss, whose gradient there is 0); the normalizer stays the whole "
                                          "batch's, so loss and gradients change only by summation order.")
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)

    def __post_init__(self) -> None:
        _one_of("trainer.algo.name", self.name, ALGORITHM_PRESETS)
        _one_of("trainer.algo.advantage_norm", self.advantage_norm, ("mean", "std"))
        _one_of("trainer.algo.advantage_std", self.advantage_std, ("unbiased", "population"))
        _one_of("trainer.algo.loss_agg", self.loss_agg, ("token", "sequence", "constant"))
        _check(0 < self.clip_eps < 1, "trainer.algo.clip_eps", self.clip_eps, "must be in (0, 1)")
        _check(self.clip_eps_high is None or self.clip_eps_high > 0, "trainer.algo.clip_eps_high",
               self.clip_eps_high, "must be null (= trainer.algo.clip_eps) or > 0")
        _check(self.tis_cap is None or self.tis_cap > 0, "trainer.algo.tis_cap", self.tis_cap,
               "must be null (off) or > 0 (e.g. 2.0)")
        _check(self.kl_coef >= 0, "trainer.algo.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.updates_per_batch >= 1, "trainer.algo.updates_per_batch", self.updates_per_batch,
               "must be >= 1")


@dataclass
class OptimConfig(Freezable):
    """The optimizer and its schedule (trainer.lr is the peak learning rate). A preset of
    conf/trainer/optim/ (trainer/optim=adamw_8bit) picks the optimizer."""

    name: str = described("adamw", "adamw: torch AdamW, state in the trainer's dtype. adamw_8bit: "
                          "bitsandbytes' block-wise 8-bit AdamW (2 bytes of state per parameter "
                          "instead of 8). adamw_bf16_sr: torchao's AdamW with bf16 state and "
                          "stochastic rounding of bf16 parameters (trainer.memory.precision=pure, "
                          "model.dtype=bfloat16).")
    weight_decay: float = described(0.0, "AdamW's decoupled weight decay.")
    betas: list[float] = described(help="AdamW's two moment decay rates, each in [0, 1).",
                                   factory=lambda: [0.9, 0.999])
    max_grad_norm: float = described(1.0, "Gradients are clipped to this global L2 norm.")
    lr_schedule: str = described("constant", "constant | linear | cosine: after the warmup, constant or a "
                                 "decay to 0 at trainer.steps (transformers' get_*_schedule_with_warmup).")
    warmup_steps: int = described(0, "The lr rises linearly from 0 over these steps (step 0 trains at lr 0 "
                                  "when > 0).")
    max_nonfinite_steps: int = described(3, "A step whose loss or grad norm is inf/NaN is skipped (no "
                                         "update); this many in a row stop the run (TrainingDiverged) with "
                                         "a checkpoint of the last good state.")

    def __post_init__(self) -> None:
        _one_of("trainer.optim.name", self.name, OPTIMIZERS)
        _check(self.weight_decay >= 0, "trainer.optim.weight_decay", self.weight_decay, "must be >= 0")
        _check(self.max_grad_norm > 0, "trainer.optim.max_grad_norm", self.max_grad_norm, "must be > 0")
        _one_of("trainer.optim.lr_schedule", self.lr_schedule, ("constant", "linear", "cosine"))
        _check(self.max_nonfinite_steps >= 1, "trainer.optim.max_nonfinite_steps", self.max_nonfinite_steps,
               "must be >= 1")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "trainer.optim.betas",
               self.betas, "must be two numbers in [0, 1)")


@dataclass
class MemoryConfig(Freezable):
    """Where the trainer's state lives and in what precision: what leaves the GPU while the engine
    is awake, what comes back when, what is kept or recomputed."""

    precision: str = described("auto", "auto | mixed | pure. mixed: fp32 master weights and optimizer state, "
                               "forward/backward autocast to model.dtype on a GPU (fp32 compute on a CPU); "
                               "the engine gets the masters cast to model.dtype at every push. pure: "
                               "everything in model.dtype; under bf16 an AdamW step of a small lr rounds "
                               "away for most weights. auto: mixed when model.dtype is bfloat16 or "
                               "float16, else pure.")
    fp32_activations: bool = described(True, "Under precision=mixed on a GPU. true (TRL's default: torch "
                                       "autocast): the activations between the matmuls (residual stream, "
                                       "norms, what backward keeps) stay fp32. false (verl's FSDP and "
                                       "Megatron's default): the whole model computes in model.dtype from "
                                       "weight copies made once per update, the gradients still summed "
                                       "into the fp32 masters: fewer bytes moved and kept, at the rounding "
                                       "of a 16-bit residual stream.")
    offload: str = described("auto", "auto | all | optimizer | none: what leaves the GPU while the engine "
                             "is awake. auto: the start-up memory plan (colo_rl.planner) keeps on the GPU "
                             "whatever fits beside the awake engine (on a CPU: all).")
    overlap_restore: bool = described(True, "CUDA: the optimizer's state comes back on a side stream, under "
                                      "the next step's scoring and forward/backward; false waits for all of "
                                      "it in the restore phase.")
    restore_while_awake: bool = described(True, "Restore before the engine sleeps when the GPU has room for "
                                          "both (checked every step): the copies then run before the "
                                          "engine frees its memory, not in the contended moment after it.")
    keep_cache: bool = described(False, "Keep torch's allocator cache (about the train step's peak) while "
                                 "the engine is awake, where the plan finds room for both: saves emptying "
                                 "and allocating it again every step, at the price of a device peak of "
                                 "trainer peak + awake engine. Off by default: memory is the scarcer.")
    gradient_checkpointing: bool = described(False, "Recompute activations in backward: less memory, more "
                                             "compute.")
    logprob_recompute: Any = described("auto", type_name="bool or auto", help=(
        "With the fused head (trainer.perf.fused_head): true recomputes each chunk's logits in "
        "backward; false keeps them from forward (micro-batch x max_tokens x vocab in model.dtype at "
        "the peak) and saves one head matmul per chunk. auto: the memory plan keeps them where they "
        "fit beside the chosen micro-batch (after it: a larger micro-batch gains more); true where "
        "nothing is planned (a CPU, trainer.parallel)."))

    def __post_init__(self) -> None:
        _one_of("trainer.memory.precision", self.precision, ("auto", "mixed", "pure"))
        _one_of("trainer.memory.offload", self.offload, ("auto", "all", "optimizer", "none"))
        _check(self.logprob_recompute == "auto" or isinstance(self.logprob_recompute, bool),
               "trainer.memory.logprob_recompute", self.logprob_recompute, "must be true, false or auto")


@dataclass
class PerfConfig(Freezable):
    """How the train step computes: kernels, compilation, the chunked output head. Same results up
    to float summation order; speed and peak memory differ."""

    logprob_chunk: int = described(1024, "Response positions per chunk of the output head in the log-prob "
                                   "forward: each chunk's logits (chunk x vocab) are reduced to log-sum-exp "
                                   "and the sampled token's logit, and recomputed in backward, so the "
                                   "(micro-batch x length x vocab) logits never exist; 0: the full logits.")
    logprob_kernel: str = described("auto", "auto | compiled | eager: how each chunk's logits become "
                                    "log-probs (the cast to fp32, the temperature, log-sum-exp, the sampled "
                                    "token's logit; in backward the softmax gradient). compiled: one "
                                    "torch.compile'd function (Inductor fuses them into a kernel or two "
                                    "reading the head's bf16 logits, where eager runs each op as a pass over "
                                    "fp32 logits). auto: compiled on a CUDA trainer, eager elsewhere "
                                    "(Inductor on a CPU needs a C++ compiler and compiles slowly).")
    fused_head: bool = described(True, "The output head (a plain bias-free linear layer) and the chunks' "
                                 "log-softmax as one autograd function (colo_rl/trainer/head.py): the "
                                 "head's weight cast once per micro-batch, not in every chunk and its "
                                 "recomputation, and its gradient summed over the chunks in fp32 inside the "
                                 "matmuls on CUDA; same values. false: each chunk through the head module "
                                 "under activation checkpointing (a LoRA-adapted or otherwise wrapped head "
                                 "always goes that way).")
    fuse_grad_accumulation: bool = described(True, "Under the weight copies of mixed precision on a GPU "
                                             "(not with DDP/FSDP, LoRA or compiled layers): each linear "
                                             "layer's weight gradient is summed into the fp32 master "
                                             "gradient inside its matmul (Megatron's gradient-accumulation "
                                             "fusion), not made in bf16 and added after: one pass less over "
                                             "the weights per micro-batch, and no bf16 rounding of each "
                                             "micro-batch's part.")
    sort_by_length: bool = described(True, "Sequences go into micro-batches in order of length, so each pads "
                                     "to a length near its own (same loss and gradients up to float "
                                     "summation order); false: in batch order.")
    kernels: str = described("auto", "auto | none | liger: Liger's fused Triton kernels for RMSNorm, SwiGLU "
                             "and RoPE (a CUDA trainer, liger-kernel installed, a model type it knows); the "
                             "same computation in fewer passes over the activations. auto: liger wherever "
                             "it can run (not with trainer.perf.compile), else none.")
    compile: bool = described(False, "torch.compile each decoder layer (regional: compiled once, reused by "
                              "every layer); the first train step pays the compilation.")
    peak_tflops: Optional[float] = described(None, "Dense bf16 peak of the training device in TFLOP/s, for "
                                             "perf/mfu; null: the data-sheet figure of a known GPU "
                                             "(colo_rl/trainer/flops.py), no MFU logged on a CPU or an "
                                             "unknown GPU.")

    def __post_init__(self) -> None:
        _one_of("trainer.perf.logprob_kernel", self.logprob_kernel, ("auto", "compiled", "eager"))
        _check(self.logprob_chunk >= 0, "trainer.perf.logprob_chunk", self.logprob_chunk,
               "must be >= 0 (response positions per chunk of the output head; 0: full logits)")
        _one_of("trainer.perf.kernels", self.kernels, ("auto", "none", "liger"))
        _check(not (self.kernels == "liger" and self.compile), "trainer.perf.kernels", self.kernels,
               "cannot be combined with trainer.perf.compile=true: Dynamo does not trace Liger's Triton "
               "kernels (the compiled Liger model's log-probs differ from the same model run "
               "eagerly); set trainer.perf.kernels=auto (it leaves Liger off when compiling) or "
               "trainer.perf.compile=false")
        _check(self.peak_tflops is None or self.peak_tflops > 0, "trainer.perf.peak_tflops", self.peak_tflops,
               "must be null (the device's known peak) or > 0 (TFLOP/s)")


@dataclass
class CheckpointConfig(Freezable):
    """When the run writes checkpoints, where it resumes from, and the exported model."""

    every: int = described(0, "Steps between checkpoints; 0: only at the end and on interruption.")
    final: bool = described(True, "false: no checkpoint at the end (a sweep that wants metrics only); a "
                            "failure still writes one.")
    background: bool = described(False, "true: periodic and final checkpoints are copied to host memory "
                                 "(the step waits for that copy only) and written on a thread while the "
                                 "run goes on; needs host memory for one more copy of the trainer's state.")
    resume: Optional[str] = described(None, "A checkpoint/ directory written by an earlier run, to continue "
                                      "from.")
    export: bool = described(False, "At the end, write a Hugging Face model directory from the last "
                             "checkpoint.")
    export_dir: Optional[str] = described(None, "Where trainer.checkpoint.export writes; null: "
                                          "OUTPUT_DIR/export.")

    def __post_init__(self) -> None:
        _check(self.every >= 0, "trainer.checkpoint.every", self.every, "must be >= 0")
        if self.export:
            _check(self.final, "trainer.checkpoint.final", self.final,
                   "but trainer.checkpoint.export=true exports the final checkpoint: set one of them right")
        if self.export_dir is not None:
            _check(self.export, "trainer.checkpoint.export_dir", self.export_dir,
                   "is set but trainer.checkpoint.export=false: add trainer.checkpoint.export=true")
            _check(not os.path.isfile(self.export_dir), "trainer.checkpoint.export_dir", self.export_dir,
                   "is a file: give a directory for the exported model")
        if self.resume is not None:
            _check(os.path.isfile(os.path.join(self.resume, "manifest.json")), "trainer.checkpoint.resume",
                   self.resume, "is not a checkpoint directory (no manifest.json in it): point it "
                   "at the checkpoint/ directory of an earlier run")


@dataclass
class TrainerConfig(Freezable):
    """The trainer: the keys typed every day (steps, prompts per step, lr, micro-batch) here, the rest
    grouped by concern: algo, optim, memory, perf, checkpoint, lora."""

    steps: int = described(30, "Training steps: each generates rollouts and updates the policy on them.")
    prompts_per_step: int = described(8, "Prompts per step; each gets sampling.n completions.")
    lr: float = described(1e-3, "Peak learning rate (suits the tiny embedded model; real models want far "
                          "smaller); its schedule: trainer.optim.*.")
    micro_batch_size: Any = described("auto", type_name="int or auto", help=(
        "Sequences per forward/backward; gradients accumulate over them (the loss's normalizer is "
        "the whole batch's, so the size changes results only by summation order). Larger is "
        "faster and needs more memory. auto: the memory plan picks the largest of "
        "colo_rl.config.AUTO_MICRO_BATCHES that fits beside the sleeping engine on a GPU; "
        "DEFAULT_MICRO_BATCH on CPU and under trainer.parallel."))
    device: str = described("auto", "auto | cuda | cpu: where the trainer runs; auto: CUDA when torch sees "
                            "a GPU.")
    seed: int = described(0, "Seed of torch's random state in the trainer (adapter initialisation, "
                          "dropout) and of the engine.")
    parallel: str = described("none", "none | ddp | fsdp: data parallel over torchrun's ranks (one GPU each).")
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _one_of("trainer.device", self.device, ("auto", "cuda", "cpu"))
        _one_of("trainer.parallel", self.parallel, ("none", "ddp", "fsdp"))
        if self.parallel == "fsdp":
            if self.memory.offload == "auto":
                self.memory.offload = "none"
            _check(self.memory.offload == "none", "trainer.memory.offload", self.memory.offload,
                   "must be none with trainer.parallel=fsdp (the shards stay on their GPUs; "
                   "use trainer.parallel=ddp to offload)")
            _check(self.algo.kl_coef == 0, "trainer.algo.kl_coef", self.algo.kl_coef,
                   "must be 0 with trainer.parallel=fsdp (no sharded reference model yet)")
            _check(self.checkpoint.resume is None, "trainer.checkpoint.resume", self.checkpoint.resume,
                   "is not supported with trainer.parallel=fsdp yet: resume with trainer.parallel=ddp")
            _check(self.lora.rank == 0, "trainer.lora.rank", self.lora.rank,
                   "must be 0 with trainer.parallel=fsdp (the merged push does not gather sharded "
                   "adapters yet): use trainer.parallel=ddp with LoRA")
        for key in ("steps", "prompts_per_step"):
            _check(getattr(self, key) >= 1, f"trainer.{key}", getattr(self, key), "must be >= 1")
        m = self.micro_batch_size
        _check(m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m >= 1),
               "trainer.micro_batch_size", m, "must be >= 1 or auto")
        _check(self.lr > 0, "trainer.lr", self.lr, "must be > 0")
        _check(0 <= self.optim.warmup_steps < self.steps, "trainer.optim.warmup_steps", self.optim.warmup_steps,
               f"must be in [0, trainer.steps={self.steps}) (the lr reaches trainer.lr after them)")


@dataclass
class ToyConfig(Freezable):
    """The built-in toy tasks' prompts: random strings over `alphabet`, generated from task.seed."""

    target: str = described("a", "The character the target_char task rewards.")
    prompt_len: int = described(4, "Random characters per prompt.")
    alphabet: str = described("abcdefghijklmnopqrstuvwxyz", "Characters prompts are drawn from.")

    def __post_init__(self) -> None:
        _check(len(self.target) == 1, "task.toy.target", self.target, "must be one character")
        _check(self.prompt_len >= 1, "task.toy.prompt_len", self.prompt_len, "must be >= 1")
        _check(len(self.alphabet) >= 1, "task.toy.alphabet", self.alphabet,
               "must hold at least one character (prompts are drawn from it)")


@dataclass
class DatasetConfig(Freezable):
    """A Hugging Face dataset read offline: a local JSON/JSONL/CSV/Parquet file, a save_to_disk
    directory, or a hub dataset id already in the local cache."""

    path: Optional[str] = described(None, "A .json/.jsonl/.csv/.parquet file, a save_to_disk directory, or "
                                    "a hub dataset id already in the local cache.")
    split: str = described("train", "The training split; slices work for files and hub data: train[:90%].")
    eval_split: Optional[str] = described(None, "Split of the held-out prompts; null: eval.size rows held "
                                          "out of `split`.")
    prompt_column: Optional[str] = described("prompt", "Column of plain-text prompts, wrapped by "
                                             "model.prompt_template (and the chat template if on).")
    messages_column: Optional[str] = described(None, "Column of chat-format prompts [{role, content}, ...]; "
                                               "replaces prompt_column.")
    reward_columns: Optional[list[str]] = described(None, "Columns passed to the reward functions; null: "
                                                    "every column besides the prompt's.")

    def __post_init__(self) -> None:
        _check(bool(self.prompt_column) or bool(self.messages_column), "task.dataset.prompt_column",
               self.prompt_column, "or task.dataset.messages_column must name the column prompts are in")


@dataclass
class TaskConfig(Freezable):
    """Where prompts come from and how completions are scored."""

    name: str = described("target_char", "A label for the task in the run's config.")
    kind: str = described("target_char", "target_char | copy (built-in toys) | dataset (task.dataset).")
    rewards: list[str] = described(help="Reward functions by import path (module:function; the run's "
                                   "directory is on sys.path) or built-in name; their weighted sum is the "
                                   "GRPO reward.", factory=lambda: ["target_char"])
    reward_weights: list[float] = described(help="One weight per reward function; empty: all 1.", factory=list)
    overlong_buffer: float = described(0.0, "DAPO's soft overlong punishment (the built-in reward "
                                       "`overlong`, added to task.rewards when > 0): the last this share of "
                                       "sampling.max_tokens costs up to task.overlong_penalty; 0: off.")
    overlong_penalty: float = described(1.0, "Weight of the overlong punishment (its largest cost).")
    reward_timeout_s: float = described(600.0, "Seconds one reward function's call may take on one batch; "
                                        "past it the run stops naming the function, with a checkpoint of "
                                        "the steps done (a function that never returns would hang it).")
    max_prompt_tokens: Optional[int] = described(None, "Longer prompts are skipped (counted and logged); "
                                                 "null: generator.max_model_len - sampling.max_tokens.")
    seed: int = described(0, "The order prompts are drawn in (shuffled epochs), and the toys' rows.")
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

    every: int = described(10, "Steps between held-out evaluations; 0: no evaluation.")
    size: int = described(32, "Held-out prompts per evaluation (the first of the held-out set).")
    n: int = described(1, "Completions per prompt, for eval/pass_at_<n>.")
    temperature: float = described(0.0, "Sampling temperature of the evaluation; 0: greedy (then n must "
                                   "be 1).")
    pass_reward: float = described(1.0, "A completion passes when its reward is at least this.")

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

    backend: str = described("wandb", "wandb | none: where metrics go besides metrics.jsonl.")
    mode: str = described("auto", "auto | online | offline | disabled: W&B's mode; auto: online when a W&B "
                          "API key is configured, else offline.")
    project: str = described("colo_rl", "W&B project.")
    entity: Optional[str] = described(None, "W&B entity (user or team); null: the API key's default.")
    group: Optional[str] = described(None, "W&B group; null: in a multirun, the sweep directory.")
    name: Optional[str] = described(None, "W&B run name; null: in a multirun, the job's overrides.")
    tags: list[str] = described(help="W&B tags.", factory=list)
    progress: bool = described(True, "One progress bar over the steps.")
    log_completions: int = described(8, "First completions of each step written to samples.jsonl and a W&B "
                                     "table; 0: none.")

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
    output_dir: Optional[str] = described(None, "The run's directory; null: Hydra's runtime.output_dir.")
    overwrite_output_dir: bool = described(False, "true: a run without trainer.checkpoint.resume into a directory "
                                           "holding an earlier run's checkpoint replaces it (and drops its "
                                           "metrics); false: such a run is refused.")
    debug: bool = described(False, "true: input errors show their traceback too (colo_rl.cli).")


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
    if t.algo.advantage_norm == "std":
        _check(s.n >= 2, "sampling.n", s.n,
               "must be >= 2 with trainer.algo.advantage_norm=std (a group of one has no std); "
               "use trainer.algo.advantage_norm=mean or a larger group")
    if t.algo.tis_cap is not None:
        _check(s.logprobs, "sampling.logprobs", s.logprobs,
               f"must be true with trainer.algo.tis_cap={t.algo.tis_cap} (the importance weights need the "
               "engine's sampled log-probs); set sampling.logprobs=true or trainer.algo.tis_cap=null")
        _check(s.logprobs_every in (None, 1), "sampling.logprobs_every", s.logprobs_every,
               f"must be 1 or null with trainer.algo.tis_cap={t.algo.tis_cap} (the importance weights need the "
               "engine's log-probs on every step); set sampling.logprobs_every=null or trainer.algo.tis_cap=null")
        mode = g.engine_kwargs.get("logprobs_mode", "processed_logprobs")
        _check(s.temperature == 1 or mode == "processed_logprobs", "sampling.temperature", s.temperature,
               f"needs generator.engine_kwargs.logprobs_mode=processed_logprobs (colo_rl's default) with "
               f"trainer.algo.tis_cap={t.algo.tis_cap}: {mode!r} are log-probs before the temperature, the "
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
    would be stored and ignored: refused, naming it (a key of the old trainer layout: naming its
    new place, colo_rl.config_moves). Free-form dicts (generator.engine_kwargs) take any key."""
    from colo_rl.config_moves import moved_message

    for key in _added_keys(cfg, ""):
        moved = moved_message(key)
        if moved:
            raise ConfigError(moved)
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
    """trainer.memory.precision with `auto` resolved: fp32 masters whenever the engine's dtype is 16-bit."""
    if settings.trainer.memory.precision != "auto":
        return settings.trainer.memory.precision
    return "mixed" if settings.model.dtype in ("bfloat16", "float16") else "pure"


# trainer.micro_batch_size=auto: the memory plan takes the largest of these whose activations fit
# beside the sleeping engine (larger micro-batches run faster until the GPU is saturated, and 32
# was where the gain ended on a 1B model); DEFAULT_MICRO_BATCH where nothing is planned (a CPU run,
# a model the planner cannot read) and under trainer.parallel, whose ranks must agree on it
AUTO_MICRO_BATCHES = (32, 16, 8, 4, 2, 1)
DEFAULT_MICRO_BATCH = 16


def micro_batch_size(t: "TrainerConfig") -> int:
    """trainer.micro_batch_size as a number: auto left unresolved (no memory plan) is DEFAULT_MICRO_BATCH."""
    return DEFAULT_MICRO_BATCH if t.micro_batch_size == "auto" else t.micro_batch_size


def logprob_recompute(t: "TrainerConfig") -> bool:
    """trainer.memory.logprob_recompute as a bool: auto left unresolved (no memory plan) recomputes."""
    return True if t.memory.logprob_recompute == "auto" else bool(t.memory.logprob_recompute)


def trainer_dtype(settings: RunConfig) -> str:
    """The dtype of the trainer's parameters and optimizer state."""
    return "float32" if trainer_precision(settings) == "mixed" else settings.model.dtype


def _check_precision(settings: RunConfig) -> None:
    import importlib.util

    t = settings.trainer
    if t.lora.rank and importlib.util.find_spec("peft") is None:
        raise ConfigError(f"trainer.lora.rank={t.lora.rank} needs the package peft, which is not installed "
                          "here: pip install 'colo_rl[lora]', or set trainer.lora.rank=0")
    package = OPTIMIZER_PACKAGES[t.optim.name]
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"trainer.optim.name={t.optim.name} needs the package {package}, which is not "
                          f"installed here: pip install {package}, or use trainer.optim.name=adamw")
    if t.optim.name == "adamw_bf16_sr" and not (settings.model.dtype == "bfloat16"
                                               and trainer_precision(settings) == "pure"):
        raise ConfigError(f"trainer.optim.name=adamw_bf16_sr rounds bf16 parameters stochastically, but "
                          f"model.dtype={settings.model.dtype} and trainer.memory.precision={t.memory.precision}: set "
                          "model.dtype=bfloat16 trainer.memory.precision=pure, or use trainer.optim.name=adamw")
    if t.optim.name == "adamw_8bit" and t.parallel == "fsdp":
        raise ConfigError("trainer.optim.name=adamw_8bit does not take FSDP's sharded parameters: use "
                          "trainer.optim.name=adamw with trainer.parallel=fsdp")


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
