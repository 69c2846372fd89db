"""Data layer: prompt sources, the rollout DataModule (RL) and the SFT DataModule (warm start)."""
from lit_ess.chat import ChatFormat

from .prompts import Arithmetic, CalculatorTranscripts, Example, HFPrompts, PromptOrder, PromptSource, encode_prompt
from .reasoning_tasks import ReasoningGym
from .rollout import RolloutDataModule
from .sft import SFTDataModule
from .verifiers_tasks import VerifiersTasks

__all__ = ["Arithmetic", "CalculatorTranscripts", "ChatFormat", "Example", "HFPrompts", "PromptOrder", "PromptSource", "ReasoningGym", "encode_prompt", "RolloutDataModule", "SFTDataModule", "VerifiersTasks"]
