"""Post-training: chat format, data, verifiable tasks, losses and the SFT/RM/DPO/PPO/GRPO/distill stages."""
