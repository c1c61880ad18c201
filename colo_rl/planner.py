"""The GPU memory plan, made at start-up before the engine starts: what each part of the time-share
takes, where it lives while the engine is awake and while the trainer trains, and from it
`trainer.memory.offload=auto` (none | optimizer | all) and `generator.gpu_memory_utilization=auto`.

Everything is arithmetic on the model's config (no model is built), the trainer's precision and
optimizer, LoRA, the micro-batch and sequence length, and the device's free and total memory
(injectable, so tests plan for any card). A config that cannot fit is refused with one ConfigError
naming the key to change and the value that would fit.

The fitted constants are data: `CALIBRATION` below, each with what it counts and where it was
measured (vLLM version, device, run of the benchmark log). They are fitted on one shape (OLMo-2
1B), so other shapes, lengths and optimizers are extrapolations; the margin and the auto choices'
headroom cover the rest. `plan_memory` reads as its decisions, one small function each, every one
returning its value and the reason printed beside it: the micro-batch (`_micro_batch`), the kept
logits (`_recompute`), the offload with the engine's budget (`_offload_and_budget`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from colo_rl.config import (AUTO_MICRO_BATCHES, DEFAULT_MICRO_BATCH, ConfigError, RunConfig, logprob_recompute,
                            micro_batch_size, trainer_precision)
from colo_rl.trainer.precision import weight_copies

log = logging.getLogger("colo_rl")

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

@dataclass(frozen=True)
class Fitted:
    """One calibrated constant of the plan: its value, what it counts, and where it comes from."""

    value: float
    counts: str
    vllm: str  # the vLLM version it was measured with; "-" where no engine is involved
    device: str  # the card it was measured on; "-" for a reserve or a choice
    run: str  # the runs in benchmarks/RESULTS.md it is fitted to, or why it is a reserve or a choice


CALIBRATION: dict[str, Fitted] = {
    "ENGINE_ASLEEP_GIB": Fitted(
        1.19, "GiB a sleeping engine keeps on the device (CUDA graphs, context)", "0.26", "H200",
        "the OLMo-2-1B shape runs, fp32 masters + AdamW, micro-batch 16 x 384"),
    "ENGINE_ACTIVATION_GIB": Fitted(
        1.0, "GiB of vLLM's own activations and sampler buffers inside its budget (its profiling run)", "-",
        "-", "a reserve for the 1B-7B shapes at the default max_num_seqs, not measured"),
    "TRAINER_CONTEXT_GIB": Fitted(
        1.0, "GiB of the trainer process's CUDA context, kernels and workspaces, outside torch's counters",
        "0.26", "H100", "run W (nothing of the trainer resident): 0.93 beyond the sleeping engine"),
    "RESIDENT_SLACK_FRACTION": Fitted(
        0.09, "what the trainer's allocator keeps between steps beyond its resident tensors (segments a "
        "live tensor pins)", "0.26", "H100", "run U: 1.39 GiB beside 16.6 GiB of masters + AdamW"),
    "ENGINE_BEYOND_BUDGET_GIB": Fitted(
        2.9, "GiB an awake engine holds beyond gpu_memory_utilization x total (not in its budget, so "
        "not in its KV cache)", "0.26", "H100", "runs U and W: 2.84 and 2.42"),
    "ACT_HIDDEN": Fitted(
        32, "activation elements per token per decoder layer, per unit of hidden (the compute dtype)",
        "-", "H200", "the two trainer peaks of the 1B shape, with and without gradient checkpointing"),
    "ACT_INTERMEDIATE": Fitted(
        4, "activation elements per token per decoder layer, per unit of intermediate", "-", "H200",
        "as ACT_HIDDEN (48 x hidden in all on the 1B shape, whose intermediate is 4 x hidden)"),
    "LIGER_ACTIVATION_FACTOR": Fitted(
        0.58, "decoder activations under trainer.perf.kernels=liger over the eager model's (fewer, smaller "
        "intermediates)", "-", "H100", "2026-12-06c: 0.57 at micro-batch 16, 0.55 at 32"),
    "BF16_ACTIVATION_FACTOR": Fitted(
        0.91, "decoder activations under trainer.memory.fp32_activations=false over autocast's (bf16 between "
        "the matmuls)", "-", "H100", "2026-12-06e: 0.92 at micro-batch 16, 0.90 at 32"),
    "LOGITS_COPIES": Fitted(
        1.25, "b x T x vocab fp32 tensors the unchunked loss holds at once (logits, log-softmax, their "
        "gradient)", "-", "H200", "the two trainer peaks of the 1B shape"),
    "CHUNK_LOGITS_COPIES": Fitted(
        2.0, "one chunk's fp32 logits and their gradient at once (trainer.perf.logprob_chunk > 0)", "-", "-",
        "a reserve: the chunk's logits and gradient, not fitted"),
    "MARGIN_FRACTION": Fitted(0.05, "share of the free memory the plan keeps free", "-", "-", "a choice"),
    "MARGIN_MIN_GIB": Fitted(1.0, "GiB the plan keeps free at least", "-", "-", "a choice"),
    "AUTO_ACTIVATION_HEADROOM": Fitted(
        0.15, "share of an auto choice's activations left free on top (a choice at the edge of an "
        "estimate would fail as an OOM mid-run)", "-", "-",
        "a choice: the activation terms fit the 1B shape within 4 % and other shapes within about 15 %"),
}
ENGINE_ASLEEP_GIB = CALIBRATION["ENGINE_ASLEEP_GIB"].value
ENGINE_ACTIVATION_GIB = CALIBRATION["ENGINE_ACTIVATION_GIB"].value
TRAINER_CONTEXT_GIB = CALIBRATION["TRAINER_CONTEXT_GIB"].value
RESIDENT_SLACK_FRACTION = CALIBRATION["RESIDENT_SLACK_FRACTION"].value
ENGINE_BEYOND_BUDGET_GIB = CALIBRATION["ENGINE_BEYOND_BUDGET_GIB"].value
ACT_HIDDEN, ACT_INTERMEDIATE = CALIBRATION["ACT_HIDDEN"].value, CALIBRATION["ACT_INTERMEDIATE"].value
LIGER_ACTIVATION_FACTOR = CALIBRATION["LIGER_ACTIVATION_FACTOR"].value
BF16_ACTIVATION_FACTOR = CALIBRATION["BF16_ACTIVATION_FACTOR"].value
LOGITS_COPIES = CALIBRATION["LOGITS_COPIES"].value
CHUNK_LOGITS_COPIES = CALIBRATION["CHUNK_LOGITS_COPIES"].value
MARGIN_FRACTION, MARGIN_MIN_GIB = CALIBRATION["MARGIN_FRACTION"].value, CALIBRATION["MARGIN_MIN_GIB"].value
AUTO_ACTIVATION_HEADROOM = CALIBRATION["AUTO_ACTIVATION_HEADROOM"].value
OFFLOAD_CHOICES = ("none", "optimizer", "all")  # least offload first
CPU_OFFLOAD = "all"  # on the CPU there is no GPU memory to plan: the path runs as before auto existed


@dataclass
class Shape:
    """What the plan needs of a decoder-only transformer's config."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf_config(cls, config) -> "Shape":
        """From a transformers PretrainedConfig (or its text_config for multimodal ones)."""
        config = getattr(config, "text_config", None) or config
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        if experts:
            raise ValueError(f"{config.model_type} is a mixture of experts ({experts}): only dense decoders are planned")
        heads = config.num_attention_heads
        hidden = config.hidden_size
        attention_bias = bool(getattr(config, "attention_bias", False))
        qwen2 = config.model_type == "qwen2"
        return cls(model_type=config.model_type, hidden=hidden, intermediate=config.intermediate_size,
                   layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or hidden // heads,
                   vocab=config.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=attention_bias or qwen2, o_bias=attention_bias and not qwen2,
                   mlp_bias=bool(getattr(config, "mlp_bias", False)))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, trust_remote_code: bool = False) -> "Shape":
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code))

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by module name."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def parameters(self) -> int:
        """The parameter count, as the built model's numel() (tied embeddings counted once)."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        layer = sum(a * b for a, b in self.linears().values())
        layer += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + (2 * i + h) * self.mlp_bias
        layer += 2 * h  # two RMSNorms
        if self.model_type == "olmo2":
            layer += q + kv  # q_norm, k_norm
        return self.layers * layer + h + self.vocab * h * (1 if self.tied else 2)

    def lora_parameters(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters: rank x (in + out) per adapted linear layer (every one by default)."""
        linears = self.linears()
        names = [n for n in linears if _targeted(n, targets)]
        return self.layers * sum(rank * sum(linears[n]) for n in names)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def _targeted(name: str, targets: list[str]) -> bool:
    """Whether LoRA adapts the linear `name` (q_proj, ...): every one when `targets` is empty."""
    return not targets or any(t == name or t.endswith("." + name) for t in targets)


@dataclass
class Component:
    name: str
    bytes: float
    awake: str  # where it is while the engine is awake: GPU | host | - (does not exist then)
    training: str  # while the trainer trains


@dataclass
class Plan:
    """What was planned. `offload` and `gpu_memory_utilization` are what the run uses."""

    offload: str
    gpu_memory_utilization: float
    components: list[Component]
    micro_batch_size: int = DEFAULT_MICRO_BATCH
    logprob_recompute: bool = True
    total_gib: float | None = None  # None: a CPU run, nothing planned on a GPU
    free_gib: float | None = None
    margin_gib: float = 0.0
    predicted: dict[str, float] = field(default_factory=dict)  # memory/<key>_predicted_gib
    notes: list[str] = field(default_factory=list)
    # what must be free on the device for the engine to wake (its budget, what it holds beyond it,
    # the least margin): the Offloader keeps torch's cache when at least this much is free; 0 with
    # trainer.memory.keep_cache off, where the cache is always emptied
    engine_wake_bytes: float = 0.0
    reasons: dict[str, str] = field(default_factory=dict)  # why each key the config left to the plan got its value

    def table(self) -> str:
        rows = [("component", "GiB", "engine awake", "training")]
        rows += [(c.name, f"{c.bytes / GIB:.2f}", c.awake, c.training) for c in self.components]
        widths = [max(len(r[k]) for r in rows) for k in range(4)]
        lines = ["  ".join(cell.rjust(w) if k == 1 else cell.ljust(w) for k, (cell, w) in
                           enumerate(zip(row, widths))).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.total_gib is None:
            head = "memory plan (CPU run: no GPU memory to plan)"
        else:
            head = (f"memory plan: device {self.total_gib:.1f} GiB, {self.free_gib:.1f} GiB free before the "
                    f"engine, margin {self.margin_gib:.1f} GiB")
        tail = [f"trainer.memory.offload -> {self.offload}" + self._why("trainer.memory.offload"),
                f"generator.gpu_memory_utilization -> {self.gpu_memory_utilization:.3f}"
                + self._why("generator.gpu_memory_utilization"),
                f"trainer.micro_batch_size -> {self.micro_batch_size}" + self._why("trainer.micro_batch_size"),
                f"trainer.memory.logprob_recompute -> {str(self.logprob_recompute).lower()}"
                + self._why("trainer.memory.logprob_recompute")]
        tail += [f"predicted {k}: {v:.2f} GiB" for k, v in self.predicted.items()]
        return "\n".join([head, *lines, *tail, *self.notes])

    def _why(self, key: str) -> str:
        return f": {self.reasons[key]}" if key in self.reasons else ""

    def metrics(self) -> dict[str, float]:
        return {f"memory/{k}_predicted_gib": v for k, v in self.predicted.items()}


@dataclass
class _Sizes:
    """The bytes of every part, for one setting of the knobs the refusal may suggest."""

    weights: float
    grads: float
    optimizer: float
    reference: float
    push_copy: float
    autocast: float
    activations: float
    engine_weights: float
    kv_per_token: float

    def trainer_peak(self) -> float:  # torch's max_memory_allocated over a train step
        return self.weights + self.grads + self.optimizer + self.reference + self.autocast + self.activations

    def awake_resident(self, offload: str) -> float:
        """What the trainer holds on the GPU while the engine generates (grads are None then): its
        resident tensors and the allocator's slack around them."""
        tensors = {"none": self.weights + self.optimizer, "optimizer": self.weights, "all": 0.0}[offload] \
            + self.reference  # the frozen reference is not offloaded
        return tensors * (1 + RESIDENT_SLACK_FRACTION)


def sizes(settings: RunConfig, shape: Shape, seq_len: int, *, cuda: bool, micro_batch: int | None = None,
          checkpointing: bool | None = None, optimizer: str | None = None,
          recompute: bool | None = None) -> _Sizes:
    t = settings.trainer
    micro_batch = micro_batch or micro_batch_size(t)
    recompute = logprob_recompute(t) if recompute is None else recompute
    checkpointing = t.memory.gradient_checkpointing if checkpointing is None else checkpointing
    optimizer = optimizer or t.optim.name
    mixed = trainer_precision(settings) == "mixed"
    engine_b = DTYPE_BYTES[settings.model.dtype]
    train_b = 4 if mixed else engine_b
    total = shape.parameters()
    lora = t.lora.rank > 0
    trainable = shape.lora_parameters(t.lora.rank, list(t.lora.target_modules)) if lora else total
    weights = total * engine_b + trainable * train_b if lora else total * train_b
    state_b = {"adamw": 2 * train_b, "adamw_8bit": 2, "adamw_bf16_sr": 4}[optimizer]
    if lora:  # the push merges each adapted weight into a fresh engine-dtype copy
        adapted = shape.layers * sum(a * b for n, (a, b) in shape.linears().items()
                                     if _targeted(n, list(t.lora.target_modules)))
        push_copy = adapted * engine_b
    else:
        push_copy = total * engine_b if train_b != engine_b else 0
    act_b = engine_b if (mixed and cuda) else train_b  # autocast computes in model.dtype on a GPU
    tokens = micro_batch * seq_len
    per_layer = tokens * act_b * (ACT_HIDDEN * shape.hidden + ACT_INTERMEDIATE * shape.intermediate)
    if checkpointing:  # each layer's input is kept, one layer's activations are recomputed at a time
        layers = shape.layers * tokens * shape.hidden * act_b + per_layer
    else:
        layers = shape.layers * per_layer
    if t.perf.kernels == "liger" and cuda:  # resolved by run.py before the plan (auto counts as eager)
        layers *= LIGER_ACTIVATION_FACTOR
    if weight_copies(mixed and cuda, t.parallel != "none", t.perf.compile, lora, t.memory.fp32_activations) == "all":
        layers *= BF16_ACTIVATION_FACTOR
    if t.perf.logprob_chunk:
        responses = micro_batch * settings.sampling.max_tokens
        logits = (CHUNK_LOGITS_COPIES * min(t.perf.logprob_chunk, responses) * shape.vocab * 4
                  + responses * shape.hidden * act_b)  # the gathered final states
        if t.perf.fused_head and not recompute:  # every response position's logits, kept for backward
            logits += responses * shape.vocab * act_b
    else:
        logits = LOGITS_COPIES * tokens * shape.vocab * 4
    return _Sizes(weights=weights, grads=trainable * train_b, optimizer=trainable * state_b,
                  reference=total * train_b if t.algo.kl_coef > 0 and not lora else 0.0,
                  push_copy=push_copy,
                  autocast=trainable * engine_b if (mixed and cuda and not lora) else 0.0,
                  activations=layers + logits, engine_weights=total * engine_b,
                  kv_per_token=shape.kv_bytes_per_token(engine_b))


def plan_memory(settings: RunConfig, shape: Shape, seq_len: int,
                device_memory: tuple[int, int] | None, engine_on_device: bool = True) -> Plan:
    """The plan for `settings` on a device with (free, total) bytes; None: a CPU run.
    `engine_on_device=False` (generator.device=cpu beside a GPU trainer): the engine takes none of it.

    Raises ConfigError when nothing fits, naming the key to change and a value that would fit.
    """
    t, g = settings.trainer, settings.generator
    cuda = device_memory is not None
    micro_batch, micro_reason = _micro_batch(settings, shape, seq_len, device_memory, engine_on_device)
    recompute, recompute_reason = _recompute(settings, shape, seq_len, device_memory, engine_on_device, micro_batch)
    reasons = {"trainer.micro_batch_size": micro_reason, "trainer.memory.logprob_recompute": recompute_reason}
    s = sizes(settings, shape, seq_len, cuda=cuda, micro_batch=micro_batch, recompute=recompute)
    asleep = ENGINE_ASLEEP_GIB * GIB if cuda else 0.0
    components = _components(settings, s, micro_batch, seq_len, recompute)

    if not cuda:
        return _host_plan(settings, components, micro_batch, recompute, reasons)

    free, total = device_memory
    training_room = _training_room(free, engine_on_device)  # the trainer's peak beside the sleeping engine
    if not engine_on_device:
        _place(components, "none")
        if s.trainer_peak() > training_room:
            raise ConfigError(_refusal(settings, shape, seq_len, s, training_room, free, 0, micro_batch))
        return Plan("none" if t.memory.offload == "auto" else t.memory.offload, 0.5 if g.gpu_memory_utilization == "auto"
                    else float(g.gpu_memory_utilization), components, micro_batch, recompute, total_gib=total / GIB,
                    free_gib=free / GIB, reasons={**reasons, "trainer.memory.offload": "generator.device=cpu: the trainer "
                                                  "keeps the GPU", "generator.gpu_memory_utilization": "unused: "
                                                  "generator.device=cpu"},
                    notes=["generator.device=cpu: the engine takes none of the GPU, the trainer stays on it"])
    margin = max(MARGIN_FRACTION * free, MARGIN_MIN_GIB * GIB)
    room = free - margin - TRAINER_CONTEXT_GIB * GIB  # what the trainer's tensors and the engine share

    if s.trainer_peak() > training_room:
        raise ConfigError(_refusal(settings, shape, seq_len, s, training_room, free, margin, micro_batch))

    (chosen, offload_reason), (budget, budget_reason) = _offload_and_budget(settings, s, free, total, room, margin,
                                                                           asleep)
    engine_fixed = s.engine_weights + asleep + ENGINE_ACTIVATION_GIB * GIB
    beyond = ENGINE_BEYOND_BUDGET_GIB * GIB  # held awake outside the engine's budget
    util = budget / total
    if g.gpu_memory_utilization == "auto":
        util = int(util * 1000) / 1000  # vLLM's budget: round down
    kv = util * total - engine_fixed
    resident = s.awake_resident(chosen)
    wake = util * total + beyond + MARGIN_MIN_GIB * GIB
    # After a train step torch's allocator holds about the step's peak; where the engine can wake
    # beside that too, and trainer.memory.keep_cache asks for it, the Offloader keeps it
    # (Offloader.keep_cache_if_free) and so does the plan.
    cached = s.trainer_peak() * (1 + RESIDENT_SLACK_FRACTION)
    keep_cache = t.memory.keep_cache and free - TRAINER_CONTEXT_GIB * GIB - cached - asleep >= wake
    if keep_cache:
        resident = max(resident, cached)
    components.append(Component("engine KV cache", kv, "GPU", "-"))
    components.append(Component("engine beyond its budget (awake)", beyond, "GPU", "-"))
    slack = resident - s.awake_resident(chosen) / (1 + RESIDENT_SLACK_FRACTION)
    if slack:
        components.append(Component("trainer allocator cache (kept: the engine wakes beside it)" if keep_cache
                                    else "trainer allocator slack", slack, "GPU", "-"))
    components.append(Component("engine asleep (CUDA graphs, context)", asleep, "GPU", "GPU"))
    _place(components, chosen)
    predicted = {
        # the trainer's peak as torch counts it (memory/trainer_peak_gib)
        "trainer_peak": s.trainer_peak() / GIB,
        # free device memory with the engine awake (memory/free_after_wake_kv_gib)
        "free_after_wake_kv": free_awake(free, total, resident, util) / GIB,
    }
    reasons.update({"trainer.memory.offload": offload_reason, "generator.gpu_memory_utilization": budget_reason})
    notes = []
    if t.memory.offload == "auto":
        notes.append(f"offload=auto: {chosen} is the least offload with the awake engine's "
                     f"{util * total / GIB:.1f} GiB, the trainer's {resident / GIB:.1f} GiB and the margin on the device")
    return Plan(chosen, util, components, micro_batch, recompute, reasons=reasons, total_gib=total / GIB,
                free_gib=free / GIB,
                margin_gib=margin / GIB,
                predicted=predicted, notes=notes,
                engine_wake_bytes=wake if t.memory.keep_cache else 0.0)


def _components(settings: RunConfig, s: _Sizes, micro_batch: int, seq_len: int, recompute: bool) -> list[Component]:
    """The plan's rows before the engine's budget is known (where offloaded parts live: "")."""
    t = settings.trainer
    components = [
        Component("trainer weights" + (" (fp32 masters)" if trainer_precision(settings) == "mixed" else ""),
                  s.weights, "", "GPU"),
        Component("gradients", s.grads, "-", "GPU"),
        Component(f"optimizer state ({t.optim.name})", s.optimizer, "", "GPU"),
    ]
    if s.reference:
        components.append(Component("reference policy (kl_coef)", s.reference, "GPU", "GPU"))
    if s.autocast:
        components.append(Component(f"autocast {settings.model.dtype} weight copies", s.autocast, "-", "GPU"))
    components.append(Component(f"activations ({micro_batch} x {seq_len} tokens"
                                + (", checkpointed" if t.memory.gradient_checkpointing else "")
                                + (", head's logits kept" if t.perf.fused_head and t.perf.logprob_chunk and not recompute else "")
                                + ")",
                                s.activations, "-", "GPU"))
    if s.push_copy:
        components.append(Component(f"push copy in {settings.model.dtype}", s.push_copy, "GPU (during push)", "-"))
    components.append(Component(f"engine weights ({settings.model.dtype})", s.engine_weights, "GPU", "-"))
    return components


def _host_plan(settings: RunConfig, components: list[Component], micro_batch: int, recompute: bool,
               reasons: dict[str, str]) -> Plan:
    """A CPU run: no GPU memory to plan; everything lives in host memory."""
    t, g = settings.trainer, settings.generator
    offload = CPU_OFFLOAD if t.memory.offload == "auto" else t.memory.offload
    util = g.gpu_memory_utilization if g.gpu_memory_utilization != "auto" else 0.5
    _place(components, offload)
    for c in components:  # no GPU: whatever lives anywhere lives in host memory
        c.awake, c.training = (_on_host(where) for where in (c.awake, c.training))
    reasons.update({"trainer.memory.offload": "a CPU run: no GPU memory to plan, everything leaves as before auto"
                    if t.memory.offload == "auto" else "as given",
                    "generator.gpu_memory_utilization": "a CPU run: the engine's KV cache is "
                    "generator.cpu_kvcache_gib" if g.gpu_memory_utilization == "auto" else "as given"})
    return Plan(offload, float(util), components, micro_batch, recompute, reasons=reasons,
                notes=[f"the engine's KV cache is generator.cpu_kvcache_gib={g.cpu_kvcache_gib} GiB of host memory"])


def _offload_and_budget(settings: RunConfig, s: _Sizes, free: float, total: float, room: float, margin: float,
                        asleep: float) -> tuple[tuple[str, str], tuple[float, str]]:
    """trainer.memory.offload and the engine's budget in bytes (generator.gpu_memory_utilization x total),
    each with its reason: the least offload whose trainer, pushed weights and awake engine fit in
    `room` bytes, with the budget that holds every sequence's KV cache (auto) or the one given;
    where none does under auto, the most offload and what is left. Raises ConfigError naming what to
    change where nothing fits."""
    t, g = settings.trainer, settings.generator
    engine_fixed = s.engine_weights + asleep + ENGINE_ACTIVATION_GIB * GIB
    beyond = ENGINE_BEYOND_BUDGET_GIB * GIB  # held awake outside the engine's budget
    engine_min = engine_fixed + g.max_model_len * s.kv_per_token  # one full sequence
    sequences = min(g.max_num_seqs, settings.sampling.n * t.prompts_per_step)
    engine_want = engine_fixed + sequences * g.max_model_len * s.kv_per_token
    # vLLM takes its whole budget when it starts, beside the trainer's freshly built weights (no
    # optimizer state yet, nothing offloaded), and refuses to start when less is free
    start_room = free - s.weights - s.reference - TRAINER_CONTEXT_GIB * GIB - MARGIN_MIN_GIB * GIB
    if g.gpu_memory_utilization != "auto" and g.gpu_memory_utilization * total > start_room:
        raise ConfigError(
            f"generator.gpu_memory_utilization={g.gpu_memory_utilization} asks vLLM for "
            f"{g.gpu_memory_utilization * total / GIB:.1f} GiB when it starts, but {free / GIB:.1f} GiB are free and "
            f"the trainer's weights take {(s.weights + s.reference) / GIB:.1f} GiB then: use "
            f"generator.gpu_memory_utilization={max(0.001, int(start_room / total * 1000) / 1000)} or auto")
    engine_want = min(engine_want, start_room)
    choices = OFFLOAD_CHOICES if t.memory.offload == "auto" else (t.memory.offload,)
    chosen = budget = None
    for offload in choices:
        resident = s.awake_resident(offload)
        # the push: the trainer's weights (+ state unless offloaded) + the engine-dtype copy + the
        # engine's weights, woken before its KV cache
        push = (s.weights + s.reference + (s.optimizer if offload == "none" else 0) + s.push_copy
                + s.engine_weights + asleep)
        if push > room:
            continue
        if g.gpu_memory_utilization == "auto":
            if resident + engine_want + beyond <= room:
                chosen, budget = offload, engine_want
                break
        elif resident + g.gpu_memory_utilization * total + beyond <= room:
            chosen, budget = offload, g.gpu_memory_utilization * total
            break
    if chosen is None and g.gpu_memory_utilization == "auto":
        # no offload leaves room for every sequence's KV cache at once: offload the most, give the
        # engine the rest (vLLM queues what does not fit)
        last = choices[-1]
        if s.awake_resident(last) + engine_min + beyond <= room and engine_min <= start_room:
            chosen, budget = last, min(room - s.awake_resident(last) - beyond, start_room)
    if chosen is None:
        most = choices[-1]
        fits = (room - s.awake_resident(most) - beyond) / total
        if g.gpu_memory_utilization != "auto" and fits * total >= engine_min:
            raise ConfigError(
                f"generator.gpu_memory_utilization={g.gpu_memory_utilization} gives the engine "
                f"{g.gpu_memory_utilization * total / GIB:.1f} GiB, but {free / GIB:.1f} GiB are free and the trainer "
                f"keeps {s.awake_resident(most) / GIB:.1f} GiB beside the awake engine with trainer.memory.offload={most} "
                f"(margin {margin / GIB:.1f} GiB): use generator.gpu_memory_utilization={int(fits * 1000) / 1000} "
                "or auto" + ("" if t.memory.offload == "auto" else ", or trainer.memory.offload=auto"))
        raise ConfigError(
            f"generator.max_model_len={g.max_model_len}: the engine needs {engine_min / GIB:.1f} GiB awake "
            f"(weights {s.engine_weights / GIB:.1f} GiB + one sequence's KV cache) but only "
            f"{(room - s.awake_resident(most) - beyond) / GIB:.1f} GiB are left beside the trainer with "
            f"trainer.memory.offload={most} on a device with {free / GIB:.1f} GiB free: "
            + ("use trainer.memory.offload=auto" if t.memory.offload != "auto" else
               "lower generator.max_model_len, use a 16-bit model.dtype or a GPU with more memory"))
    offload_reason = (f"the least offload with the awake engine's {budget / GIB:.1f} GiB, the trainer's "
                      f"{s.awake_resident(chosen) / GIB:.1f} GiB and the margin on the device"
                      if t.memory.offload == "auto" else "as given")
    budget_reason = (("every sequence's KV cache beside the trainer" if budget == engine_want else
                      "what is left beside the trainer (vLLM queues the sequences that do not fit)")
                     if g.gpu_memory_utilization == "auto" else "as given")
    return (chosen, offload_reason), (budget, budget_reason)


def _training_room(free: float, engine_on_device: bool) -> float:
    """Bytes the trainer's step may peak at on a device with `free` bytes: less the margin, its CUDA
    context and the sleeping engine (when the engine is on the device)."""
    room = free - max(MARGIN_FRACTION * free, MARGIN_MIN_GIB * GIB) - TRAINER_CONTEXT_GIB * GIB
    return room - (ENGINE_ASLEEP_GIB * GIB if engine_on_device else 0.0)


def _micro_batch(settings: RunConfig, shape: Shape, seq_len: int, device_memory: tuple[int, int] | None,
                 engine_on_device: bool) -> tuple[int, str]:
    """trainer.micro_batch_size with auto resolved, and why: on a GPU, the largest of AUTO_MICRO_BATCHES (at
    most the step's sequences) whose trainer peak, with AUTO_ACTIVATION_HEADROOM of its activations
    on top, fits beside the sleeping engine, or 1 where none does (the refusal then says what
    would); DEFAULT_MICRO_BATCH on the CPU and under trainer.parallel (each rank plans on its own
    device, and the ranks must agree)."""
    t = settings.trainer
    if t.micro_batch_size != "auto":
        return t.micro_batch_size, "as given"
    if device_memory is None:
        return DEFAULT_MICRO_BATCH, "no GPU memory to plan: the default"
    if t.parallel != "none":
        return DEFAULT_MICRO_BATCH, f"trainer.parallel={t.parallel}: the ranks must agree, the default"
    room = _training_room(device_memory[0], engine_on_device)
    sequences = t.prompts_per_step * settings.sampling.n
    for b in AUTO_MICRO_BATCHES:
        b = min(b, sequences)
        if _fits_with_headroom(sizes(settings, shape, seq_len, cuda=True, micro_batch=b), room):
            return b, (f"the largest whose trainer peak (with {AUTO_ACTIVATION_HEADROOM:.0%} of its activations "
                       f"to spare) fits beside the sleeping engine" if b < sequences else "the whole step at once")
    return 1, "none fits: the least"


def _fits_with_headroom(s: _Sizes, room: float) -> bool:
    """Whether an auto choice fits: the trainer's peak with AUTO_ACTIVATION_HEADROOM of its
    activations on top, within `room` bytes."""
    return s.trainer_peak() + AUTO_ACTIVATION_HEADROOM * s.activations <= room


def _recompute(settings: RunConfig, shape: Shape, seq_len: int, device_memory: tuple[int, int] | None,
               engine_on_device: bool, micro_batch: int) -> tuple[bool, str]:
    """trainer.memory.logprob_recompute with auto resolved, and why: on a GPU, with the fused chunked head and no
    trainer.parallel, keep the head's logits (false) where the trainer's peak with them, and
    AUTO_ACTIVATION_HEADROOM of its activations on top, still fits beside the sleeping engine at
    the micro-batch already chosen; else recompute (true)."""
    t = settings.trainer
    if t.memory.logprob_recompute != "auto":
        return bool(t.memory.logprob_recompute), "as given"
    if device_memory is None or t.parallel != "none" or not t.perf.fused_head or not t.perf.logprob_chunk:
        return True, ("nothing planned (no GPU, or trainer.parallel)" if device_memory is None or t.parallel != "none"
                      else "needs trainer.perf.fused_head and trainer.perf.logprob_chunk")
    kept = sizes(settings, shape, seq_len, cuda=True, micro_batch=micro_batch, recompute=False)
    if _fits_with_headroom(kept, _training_room(device_memory[0], engine_on_device)):
        return False, f"the head's logits fit beside micro-batch {micro_batch}: kept for backward"
    return True, f"the head's logits do not fit beside micro-batch {micro_batch}: recomputed"


def free_awake(free: float, total: float, resident: float, util: float) -> float:
    """Bytes free on the device while the engine is awake (memory/free_after_wake_kv): what was
    free before the engine, less the trainer's context and resident state, the engine's budget and
    what it holds beyond it."""
    return free - TRAINER_CONTEXT_GIB * GIB - resident - util * total - ENGINE_BEYOND_BUDGET_GIB * GIB


def _on_host(where: str) -> str:
    return where.replace("GPU", "host")


def _place(components: list[Component], offload: str) -> None:
    for c in components:
        if c.awake == "":
            offloaded = offload == "all" or (offload == "optimizer" and c.name.startswith("optimizer"))
            c.awake = "host" if offloaded else "GPU"


def _refusal(settings: RunConfig, shape: Shape, seq_len: int, s: _Sizes, room: float, free: float,
             margin: float, micro_batch: int) -> str:
    """The message for a trainer whose training phase does not fit in `room` bytes with `micro_batch`
    sequences a micro-batch (under trainer.micro_batch_size=auto: 1, the least it tried)."""
    t = settings.trainer
    head = (f"the trainer needs ~{s.trainer_peak() / GIB:.1f} GiB while training (weights {s.weights / GIB:.1f}, "
            f"gradients {s.grads / GIB:.1f}, optimizer {s.optimizer / GIB:.1f}, activations "
            f"{s.activations / GIB:.1f} GiB"
            + (" at micro-batch 1, the least trainer.micro_batch_size=auto tries" if t.micro_batch_size == "auto" else "")
            + f") but {room / GIB:.1f} GiB are left of {free / GIB:.1f} GiB free "
            f"(beside the sleeping engine, margin {margin / GIB:.1f} GiB): ")
    cuda = True

    def fits(**knobs) -> bool:
        knobs.setdefault("micro_batch", micro_batch)
        return sizes(settings, shape, seq_len, cuda=cuda, **knobs).trainer_peak() <= room

    def largest_micro_batch(**knobs) -> int:
        return max((b for b in range(1, micro_batch) if fits(micro_batch=b, **knobs)), default=0)

    b = largest_micro_batch()
    if b:
        return head + (f"trainer.micro_batch_size={micro_batch} needs ~{s.activations / GIB:.1f} GiB "
                       f"of activations; {b} fits")
    if not t.memory.gradient_checkpointing:
        if fits(checkpointing=True):
            return head + "use trainer.memory.gradient_checkpointing=true"
        b = largest_micro_batch(checkpointing=True)
        if b:
            return head + f"use trainer.memory.gradient_checkpointing=true with trainer.micro_batch_size={b}"
    if t.optim.name == "adamw" and fits(optimizer="adamw_8bit", micro_batch=1, checkpointing=True):
        return head + ("use trainer.optim.name=adamw_8bit (2 bytes of optimizer state per parameter), "
                       "with trainer.memory.gradient_checkpointing=true and a smaller trainer.micro_batch_size if needed")
    if not t.lora.rank:
        return head + "use trainer.lora.rank=16 (LoRA: gradients and optimizer state for the adapters only)"
    return head + "use a smaller model or a GPU with more memory"


def sequence_length(settings: RunConfig, task=None) -> int:
    """The longest sequence the trainer sees: the longest prompt (of the task, when known) plus
    sampling.max_tokens."""
    s, g = settings.sampling, settings.generator
    longest = settings.task.max_prompt_tokens or g.max_model_len - s.max_tokens
    if task is not None:
        from colo_rl.tasks import IDS

        lengths = [len(ids) for ids in task.train[IDS]] if IDS in task.train.column_names else []
        if lengths:
            longest = max(lengths)
    return longest + s.max_tokens


def device_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of `device`; None off CUDA."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.mem_get_info(torch.device(device))


def plan_run(settings: RunConfig, model_dir: Path, device: str, task=None,
             memory: tuple[int, int] | None = None, show: bool = True) -> Plan:
    """Plans the run and writes the resolved choices into `settings` (trainer.memory.offload,
    generator.gpu_memory_utilization); prints the table when `show`."""
    from colo_rl.config import resolve_device

    try:
        shape = Shape.from_model_dir(model_dir, trust_remote_code=settings.model.trust_remote_code)
    except (AttributeError, TypeError, ValueError) as exc:
        # not a dense decoder this planner knows (its config lacks a field): plan nothing, as before auto
        t, g = settings.trainer, settings.generator
        t.memory.offload = "all" if t.memory.offload == "auto" else t.memory.offload
        g.gpu_memory_utilization = 0.5 if g.gpu_memory_utilization == "auto" else g.gpu_memory_utilization
        t.micro_batch_size = micro_batch_size(t)
        t.memory.logprob_recompute = logprob_recompute(t)
        log.warning("no memory plan for %s (%s): trainer.memory.offload=%s, generator.gpu_memory_utilization=%s, "
                    "trainer.micro_batch_size=%s", model_dir, exc, t.memory.offload, g.gpu_memory_utilization,
                    t.micro_batch_size)
        return Plan(t.memory.offload, float(g.gpu_memory_utilization), [], t.micro_batch_size, t.memory.logprob_recompute,
                    reasons={key: f"no memory plan for this model ({exc}): the default" for key in (
                        "trainer.memory.offload", "generator.gpu_memory_utilization", "trainer.micro_batch_size",
                        "trainer.memory.logprob_recompute")})
    plan = plan_memory(settings, shape, sequence_length(settings, task),
                       memory if memory is not None else device_memory(device),
                       engine_on_device=resolve_device(settings.generator.device) != "cpu")
    settings.trainer.memory.offload = plan.offload
    settings.generator.gpu_memory_utilization = plan.gpu_memory_utilization
    settings.trainer.micro_batch_size = plan.micro_batch_size
    settings.trainer.memory.logprob_recompute = plan.logprob_recompute
    if show:
        print(plan.table(), flush=True)
    return plan
