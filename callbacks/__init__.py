"""Lightning callbacks of lit-ess."""
from .completions import LogCompletions
from .export import ExportHF
from .progress import StepProgressBar
from .ratio_dashboard import RatioDashboard
from .weight_sync import WeightSync

__all__ = ["ExportHF", "LogCompletions", "RatioDashboard", "StepProgressBar", "WeightSync"]
