"""Speculative decoding without a transport: the sampling parameters, the verification math both loops use, the draft-
target loop, the adaptive policy (costs, schedule, shared state) and the n-gram proposer."""
