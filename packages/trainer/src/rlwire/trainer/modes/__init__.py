"""The training modes: colocated, one-step off-policy and fully async (with its sample
queue), each a loop over the job's workers.

Imports ``runtime`` and everything below it."""
