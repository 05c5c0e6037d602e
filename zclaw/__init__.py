"""zclaw: a distributed, asynchronous RL trainer for manipulation with option-based policies.

Three roles (worker, broker, learner) run as independent processes and talk ZeroMQ over TCP;
see ``zclaw/core.py`` for the nouns they share and ``docs/`` for the design.
"""

__version__ = "0.1.0"
