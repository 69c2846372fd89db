"""Lightning callbacks of lit-ess."""
from .export import ExportHF
from .ratio_dashboard import RatioDashboard
from .weight_sync import WeightSync

__all__ = ["ExportHF", "RatioDashboard", "WeightSync"]
