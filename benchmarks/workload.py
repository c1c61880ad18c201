"""The peer workload, described once: the shape TRL 1.16's GRPOTrainer was measured on (issue #10),
which every benchmark here runs (peer_workload.py, peer_trl.py, train_profile.py, startup.py,
lora_adapters.py), and its CPU smoke form (the tiny model, a few short steps).

The OLMo-2-1B shape with random weights, 32 prompts x 8 completions x 256 tokens with EOS ignored,
prompts of 128 tokens, micro-batch 16 (one optimizer step per generation), lr 1e-6, the engine at
0.5 of the GPU with CUDA graphs, 6 steps; the medians are taken over steps 2.. (the first pays for
the pinned buffers and the engine's start).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Workload:
    model: str  # a preset of conf/model
    prompts: int  # per step
    n: int  # completions per prompt
    prompt_len: int  # tokens of a prompt, BOS included
    max_tokens: int  # tokens of a completion (EOS ignored: every completion is this long)
    micro: int  # trainer.micro_batch_size
    steps: int
    lr: float = 1e-6
    gpu_memory_utilization: float = 0.5  # the engine's share of the card (vLLM's, TRL's)
    max_model_len: int = 512  # colo_rl's engine
    gpu: bool = True

    def overrides(self) -> list[str]:
        """colo_rl's Hydra overrides for this workload (an arm's own overrides go after them)."""
        return [f"model={self.model}", f"trainer.steps={self.steps}", f"trainer.prompts_per_step={self.prompts}",
                f"sampling.n={self.n}", f"sampling.max_tokens={self.max_tokens}", "sampling.ignore_eos=true",
                f"task.toy.prompt_len={self.prompt_len - 1}", "eval.every=0",
                f"trainer.micro_batch_size={self.micro}", f"trainer.lr={self.lr}",
                f"generator.gpu_memory_utilization={self.gpu_memory_utilization}",
                f"generator.max_model_len={self.max_model_len}", "logger=none", "logger.progress=false"]

    def as_dict(self) -> dict:
        return asdict(self)


PEER = Workload(model="olmo2_1b_shape", prompts=32, n=8, prompt_len=128, max_tokens=256, micro=16, steps=6)
SMOKE = Workload(model="tiny", prompts=4, n=2, prompt_len=16, max_tokens=8, micro=4, steps=2, max_model_len=64,
                 gpu=False)


def workload(smoke: bool = False, model: str | None = None) -> Workload:
    """The peer workload (on another model preset if given) or, with `smoke`, its CPU form."""
    if smoke:
        return SMOKE
    return replace(PEER, model=model) if model else PEER
