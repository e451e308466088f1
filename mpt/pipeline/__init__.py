"""Pipeline parallelism: a model cut into stages over ranks, composed with data parallelism.

``--pipeline-stages P`` is the ``pp`` axis of the job's layout. ``Stages`` cuts the model
(``mpt.pipeline.split``) and keeps this rank's stage, which the data-parallel backend (ddp or
fsdp) sets up over its replicas; ``PipelineStep`` runs torch's schedule for
``rt.forward_backward``; ``StagedState`` merges the stages' state for checkpoints. None of them
is a backend. See docs/pipeline.md.
"""
