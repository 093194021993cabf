"""torch.distributed process groups, the tensor-parallel communicator and its timing, worker processes."""
