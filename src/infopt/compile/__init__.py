"""torch.compile of the model's forward (recipe stage ``compile``), over a static-shape KV cache."""

from .step import Compile, compile_

__all__ = ["Compile", "compile_"]
