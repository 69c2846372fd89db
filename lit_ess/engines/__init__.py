"""Rollout engines behind one interface: `vllm` (default, in-process) and `hf` (transformers)."""
from .base import Completion, RolloutEngine, SamplingConfig, derive_seed

ENGINES = ("vllm", "hf")


def build_engine(name: str, model_path: str, **kwargs) -> RolloutEngine:
    """Build the engine `name` ("vllm" or "hf") for `model_path`; kwargs go to its constructor."""
    if name == "vllm":
        from .vllm_engine import VLLMEngine
        return VLLMEngine(model_path, **kwargs)
    if name == "hf":
        from .hf_engine import HFEngine
        return HFEngine(model_path, **kwargs)
    raise ValueError(f"unknown engine {name!r}; valid names: {', '.join(ENGINES)}")


__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "derive_seed", "build_engine", "ENGINES"]
