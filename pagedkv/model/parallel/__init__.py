"""Tensor parallelism: the rank group (group.py), how each rank's shard is cut (sharding.py),
and the vocabulary-parallel embedding (vocab.py). The executor that runs the ranks is in
pagedkv/model/executor/."""
