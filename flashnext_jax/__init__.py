"""flashnext-jax: a JAX/Pallas inference engine for Qwen3.8-Flash-Next (HF `qwen4_exp`)."""

from .api import DEMO_MODEL, Model, load
from .config import ConfigError, ModelConfig, from_hf_config, load_config
from .weights import CheckpointError

__all__ = ["load", "Model", "DEMO_MODEL", "ModelConfig", "ConfigError", "CheckpointError", "from_hf_config",
           "load_config"]
from .llm import LLM, RequestOutput  # noqa: E402
from .sampling import SamplingParams, TokenLogprob  # noqa: E402
from .structured_output import StructuredOutputsParams  # noqa: E402

__all__ += ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "TokenLogprob"]

__all__ += ["train_mtp", "mtp_acceptance", "write_mtp"]


def __getattr__(name: str):
    """MTP-head training (optax) is imported on first use: `flashnext_jax.train_mtp(model, texts, ...)`."""
    if name in ("train_mtp", "mtp_acceptance"):
        from . import training

        return getattr(training, name)
    if name == "write_mtp":
        from .mtp_checkpoint import write_mtp

        return write_mtp
    raise AttributeError(f"module 'flashnext_jax' has no attribute {name!r}")
