"""The sleeping vLLM generator: an engine in its own process, fed the trainer's weights each step."""

from colo_rl.generator.client import EngineProcess, GeneratorError, Rollouts, VLLMGenerator

__all__ = ["EngineProcess", "GeneratorError", "Rollouts", "VLLMGenerator"]
