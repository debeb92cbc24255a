"""Scale-out: device meshes, parallel layouts applied to the plain model, sharded checkpoints,
launchers and the cluster planner. Submodules import torch.distributed on use."""
