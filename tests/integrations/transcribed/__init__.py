"""Float64 transcriptions of trainer loss functions that do not install here (prime-rl, slime, NeMo-RL)."""
