"""flashnext-jax: a JAX/Pallas inference engine for Qwen3.8-Flash-Next (HF `qwen4_exp`)."""

from .api import DEMO_MODEL, Model, load
from .config import ConfigError, ModelConfig, from_hf_config, load_config
from .weights import CheckpointError

__all__ = ["load", "Model", "DEMO_MODEL", "ModelConfig", "ConfigError", "CheckpointError", "from_hf_config",
           "load_config"]
from .llm import LLM, RequestOutput  # noqa: E402
from .sampling import SamplingParams, TokenLogprob  # noqa: E402

__all__ += ["LLM", "SamplingParams", "RequestOutput", "TokenLogprob"]
