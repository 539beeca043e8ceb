"""ampctl inside training code that ampctl did not start.

* :class:`ProtectedRun` (this package, torch only): the overflow guard
  (:class:`~ampctl.protect.protection.Protection`: attribution, rollback, forward-overflow locate and
  fp32 promotion, skip budget, floor policy) and an ampctl run folder (``metrics.jsonl``,
  ``events.jsonl``, ``summary.json``) for any loop that steps a
  :class:`~ampctl.amp.LossScaler` -- a hand-written loop, an Accelerate loop, or a framework's.
* :mod:`ampctl.integrations.lightning`: ``AmpctlCallback`` (and its precision plugin) for
  PyTorch Lightning (``pip install "ampctl[lightning]"``).
* :mod:`ampctl.integrations.accelerate`: ``install_scaler(accelerator)`` and ``protected_run``
  for Hugging Face Accelerate (``pip install "ampctl[accelerate]"``).
* :mod:`ampctl.integrations.transformers`: ``protect_trainer(trainer)`` for the Hugging Face
  ``Trainer`` (``pip install "ampctl[transformers]"``).

Each framework module imports its framework when it is imported (never from here), and says how
to install it when it is missing.
"""

from __future__ import annotations

from .common import IntegrationError, require
from .protected_run import LoopInfo, ProtectedRun

__all__ = ["IntegrationError", "LoopInfo", "ProtectedRun", "require"]
