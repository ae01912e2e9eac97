"""rlkernels inside TRL 1.16: `GRPOTrainer`, a drop-in for `trl.GRPOTrainer` (`trainer`).

    from rlkernels.integrations.trl import GRPOTrainer   # instead of: from trl import GRPOTrainer
"""

from .trainer import GRPOTrainer

__all__ = ["GRPOTrainer"]
