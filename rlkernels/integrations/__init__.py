"""Glue for trainers, a folder per trainer: `rlkernels.integrations.trl` (a drop-in `GRPOTrainer`) and
`rlkernels.integrations.verl` (the plugin `import verl` loads); `configs` (their option names) and `hf` are shared.
Each trainer's folder imports its trainer only when imported itself, so `import rlkernels` never needs one."""
