"""megatrain_nb: full-parameter LLM training on a device far smaller than the model, in notebooks."""
import logging as _logging
import re as _re


class _KnownNoise(_logging.Filter):
    """Drops the log lines third-party packages print on import that say nothing about a run: torchao's
    missing optional CUDA kernels (imported through transformers) and torch's register_constant deprecation
    of torchao's enums. Attached to those loggers only: our own warnings, and theirs of other things, pass."""

    PATTERNS = {"torchao": _re.compile(r"Failed to load .*torchao/_C\w*\.\S*\.so"),
                "torch.utils._pytree": _re.compile(r"is an Enum subclass .* register_constant\(\) on Enum subclasses "
                                                   r"is deprecated", _re.S)}

    def __init__(self, logger: str):
        super().__init__()
        self.pattern = self.PATTERNS[logger]

    def filter(self, record: _logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


for _name in _KnownNoise.PATTERNS:  # before transformers imports torchao: the loggers it will use
    _logging.getLogger(_name).addFilter(_KnownNoise(_name))

from .config import EngineConfig, OptimConfig  # noqa: E402
from .machine.planner import H200, Hardware, plan  # noqa: E402
from .session import Session, StepResult  # noqa: E402

__all__ = ["Session", "StepResult", "EngineConfig", "OptimConfig", "plan", "Hardware", "H200"]
__version__ = "0.1.0"
