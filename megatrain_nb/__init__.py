"""megatrain_nb: full-parameter LLM training on a device far smaller than the model, in notebooks."""
from .config import EngineConfig, OptimConfig
from .machine.planner import H200, Hardware, plan
from .session import Session, StepResult

__all__ = ["Session", "StepResult", "EngineConfig", "OptimConfig", "plan", "Hardware", "H200"]
__version__ = "0.1.0"
