"""What a run needs around the tricks: checkpoints and crash-safe resume, preemption, optimizer parameter groups,
weight averaging over checkpoints, and the private ``transformers`` names we rely on (:mod:`.upstream`)."""
