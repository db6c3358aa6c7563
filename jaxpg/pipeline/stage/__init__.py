"""What one pipeline stage computes, for both executors: the call's resolved config
(``config``), staged parameters and their orders (``params``, ``order``), microbatches, a
stage's jaxpr cut into ``F``, ``B`` and ``W`` (``split``, ``hoist``, ``trace_tools``), its
metadata, and ``PipelineStage``'s programs, tensor-parallel ones included (``programs``,
``tp``, ``tp_programs``, ``pipeline_stage``)."""
