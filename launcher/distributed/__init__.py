"""Distributed plumbing: who does what (topology, schedule), how hidden states travel (channel),
tensor-parallel target units, and the per-process isolation of compile state."""
