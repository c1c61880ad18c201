"""The GRPO trainer, the offloader that clears the GPU for the engine, and checkpoints."""

from colo_rl.trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from colo_rl.trainer.grpo import GRPOTrainer, TrainerOutOfMemory, TrainingDiverged
from colo_rl.trainer.loss import group_advantages, grpo_loss, loss_normalizer
from colo_rl.trainer.offload import Offloader

__all__ = ["CheckpointError", "GRPOTrainer", "Offloader", "TrainerOutOfMemory", "TrainingDiverged", "group_advantages",
           "grpo_loss", "load_checkpoint", "loss_normalizer", "save_checkpoint"]
