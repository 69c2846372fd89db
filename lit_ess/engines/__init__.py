"""Rollout engines behind one interface: `vllm` (default, in-process) and `hf` (transformers).

Each engine has a typed config (`VLLMConfig`, `HFConfig`) whose `build(model_path)` starts it; configs
name engines in YAML (`engine: {class_path: lit_ess.engines.HFConfig, init_args: {dtype: bfloat16}}`).
"""
from .base import Completion, EngineConfig, RolloutEngine, SamplingConfig, WeightTransfer, derive_seed
from .hf_engine import HFConfig
from .vllm_engine import VLLMConfig

ENGINES = {"vllm": VLLMConfig, "hf": HFConfig}


def build_engine(name: str, model_path: str, **kwargs) -> RolloutEngine:
    """Start the engine `name` ("vllm" or "hf") for `model_path`; kwargs are its config's fields."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; valid names: {', '.join(ENGINES)}")
    return ENGINES[name](**kwargs).build(model_path)


__all__ = ["Completion", "EngineConfig", "HFConfig", "RolloutEngine", "SamplingConfig", "VLLMConfig", "WeightTransfer",
           "derive_seed", "build_engine", "ENGINES"]
