"""lattice_mlx: Qwen3.5 GDN-hybrid models on MLX with exact MTP speculative decoding."""

import warnings

from . import startup  # noqa: F401  (first: Ctrl-C while a command's imports run is one line)

# `python -m lattice_mlx.generate` runs a module this package has already imported (for the public API below);
# that is intended, so runpy's warning about it is noise.
warnings.filterwarnings("ignore", message=r".*found in sys.modules after import of package 'lattice_mlx'")

from .batch import BatchDecoder  # noqa: E402
from .generate import GenerationResponse, GenerationResult, batch_generate, generate, stream_generate  # noqa: E402
from .load import LoadError, load  # noqa: E402
from .sample import Sampler  # noqa: E402
from .speculative import SpecOptions, SpecStats, make_draft_model, speculate  # noqa: E402

__version__ = "0.1.0"
__all__ = ["BatchDecoder", "GenerationResponse", "GenerationResult", "LoadError", "Sampler", "SpecOptions", "SpecStats", "batch_generate", "generate",
           "load", "make_draft_model", "speculate", "stream_generate"]
