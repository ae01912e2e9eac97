"""Glue for trainers: `rlkernels.integrations.trl` (a drop-in `GRPOTrainer`). Each submodule imports its
trainer only when imported itself, so `import rlkernels` never needs one."""
