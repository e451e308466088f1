"""The portable form of training state that backends produce and checkpoints store.

Neither side owns it: a backend hands out optimizer state keyed by parameter name
(``mpt.state.named``) and, where it shards, flat element ranges (``mpt.state.flat``); the
checkpoint writes and reads those without knowing which backend made them.
"""
