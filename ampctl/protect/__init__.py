"""The protection, loop-independent: what ampctl's own loop and every integration share.

* :class:`~ampctl.protect.protection.Protection` carries out the guard's decisions (snapshot,
  rollback, attribution, promotion to fp32, fp8 layer demotion, precision fallback);
* :mod:`~ampctl.protect.figures`: the log step's device figures, read in one transfer;
* :mod:`~ampctl.protect.logger`: the run's logger (run folder, display, sinks);
* :mod:`~ampctl.protect.settings`: the ``guard.*`` and ``logging.*`` config groups.

Nothing here knows which loop calls it: ``ampctl train``'s
:class:`~ampctl.train.trainer.Trainer` and :class:`~ampctl.integrations.ProtectedRun` (and the
Lightning, Accelerate and HF Trainer integrations built on it) call the same functions.
"""

from .protection import Protection, TrainAborted
from .settings import GuardConfig, LoggingConfig

__all__ = ["GuardConfig", "LoggingConfig", "Protection", "TrainAborted"]
