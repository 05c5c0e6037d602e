"""Networks and losses: the option policy both workers (acting) and the learner (training) build."""
from .networks import OptionPolicy, PolicyConfig
from .normalizer import RunningNorm

__all__ = ["OptionPolicy", "PolicyConfig", "RunningNorm"]
