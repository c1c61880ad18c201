"""The sleeping vLLM generator: an engine in its own process, fed the trainer's weights each step.

The names below are imported when first used: the worker (`colo_rl.generator.worker`) and
`colo_rl.generator.process` must not pay for torch, which `client` imports."""

__all__ = ["EngineProcess", "GeneratorError", "Rollouts", "VLLMGenerator"]


def __getattr__(name: str):
    if name in __all__:
        from colo_rl.generator import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
