"""`mpt plan`: every layout mpt can run for a model on a cluster, priced before it runs.

- ``profiles``: named datasheet devices and links (with their sources);
- ``calibrate``: the same figures measured on this machine (`mpt plan --calibrate`);
- ``workload``: the model's ops per block, on the meta device;
- ``network``: a collective's time and bytes on the cluster's links;
- ``layouts``: the layouts, built through ``RunConfig`` so that refusals are mpt's own;
- ``cost``: one layout's memory, step time, bytes and limit;
- ``planner``: all of it for one model and cluster, ranked.

What differs between backends each backend declares, and the planner reads from the registry:
``estimate_memory`` and ``estimate_row`` (its state per rank), ``estimate_buffers`` (what it
holds beyond), ``step_traffic`` (what it sends per step, and what it can hide, as
``mpt.parallel.traffic`` values) and ``plan_variants`` (its options worth comparing).
"""
