"""Glue for trainers: `rlkernels.integrations.trl` (a drop-in `GRPOTrainer`) and `rlkernels.integrations.verl` (the
plugin `import verl` loads) are folders; `skyrl`, `openrlhf`, `torchtitan`, `areal`, `prime_rl`, `slime` and `nemo_rl`
are one module each (docs/integrations.md); `configs` (verl's and TRL's option names) and `hf` are shared. Each
adapter imports its trainer only when imported itself (or when its one line runs), so `import rlkernels` never needs
one, and none changes its trainer until selected."""
