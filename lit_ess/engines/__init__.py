"""Rollout engines behind one interface: in-process vLLM (default), vLLM's own server, transformers' `generate`;
and an LLM judge (`LLMJudge`, a reward) through a vLLM server's OpenAI API.

Each engine has a typed config (`VLLMConfig`, `VLLMServerConfig`, `HFConfig`) whose `build(model_path)` starts it; configs
name engines in YAML (`engine: {class_path: lit_ess.engines.HFConfig, init_args: {dtype: bfloat16}}`),
code builds them the same way (`VLLMConfig(dtype="bfloat16").build(model_path)`).
"""
from .base import EngineConfig, EngineFault, RolloutEngine, WeightTransfer
from .hf_engine import HFConfig
from .judge import LLMJudge
from .vllm_engine import VLLMConfig
from .vllm_server import VLLMServerConfig

__all__ = ["EngineConfig", "EngineFault", "HFConfig", "LLMJudge", "RolloutEngine", "VLLMConfig", "VLLMServerConfig", "WeightTransfer"]
