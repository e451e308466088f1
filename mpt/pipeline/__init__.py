"""Pipeline parallelism: a model cut into stages over ranks, composed with data parallelism.

``--pipeline-stages P`` cuts the model (``mpt.pipeline.split``), ``PipelineBackend`` keeps this
rank's stage and wraps it with the data-parallel backend, and ``PipelineStep`` runs torch's
schedule for ``rt.forward_backward``. See docs/pipeline.md.
"""
