"""Stage 4, feed: the torch side, on each training process.

plan.py cuts the rows into every rank's share (equal steps per rank) and the hold-out; dataset.py
holds a rank's rows in one packed tensor; sampler.py orders them per epoch (resumable on any number of
ranks); loader.py hands batches to the device (pinned memory, non_blocking copies); metrics.py measures
data wait and rows/s; grow.py grows an embedding table to a warm start's new ids.
"""
