"""lit-ess: RL post-training of language models on PyTorch Lightning with the batch-adaptive ESS
objective (P3O) and its baselines."""
from .objectives import ObjectiveOutput, aggregate, batch_ess

__version__ = "0.1.0"
__all__ = ["ObjectiveOutput", "aggregate", "batch_ess"]
