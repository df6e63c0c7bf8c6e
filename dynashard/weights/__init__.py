"""Weights: the store of each rank's shards, the facades left in place of full tensors, freeing and filling them."""
