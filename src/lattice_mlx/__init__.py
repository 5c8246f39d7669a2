"""lattice_mlx: Qwen3.5 GDN-hybrid models on MLX with exact MTP speculative decoding."""

from .generate import GenerationResponse, GenerationResult, generate, stream_generate
from .load import LoadError, load
from .sample import Sampler
from .speculative import SpecStats

__all__ = ["GenerationResponse", "GenerationResult", "LoadError", "Sampler", "SpecStats", "generate", "load",
           "stream_generate"]
__version__ = "0.1.0"
