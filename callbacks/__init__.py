"""Lightning callbacks of lit-ess."""
from .completions import LogCompletions
from .export import ExportHF
from .fsdp import FSDP2
from .progress import StepProgressBar
from .ratio_dashboard import RatioDashboard
from .summary import ModelSummary
from .weight_sync import WeightSync

__all__ = ["ExportHF", "FSDP2", "LogCompletions", "ModelSummary", "RatioDashboard", "StepProgressBar", "WeightSync"]
