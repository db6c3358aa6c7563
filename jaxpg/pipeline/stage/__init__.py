"""What one pipeline stage computes, for both executors: the call's resolved config
(``config``), staged parameters and their orders (``params``, ``order``), microbatches, a
stage's jaxpr cut into ``F``, ``B`` and ``W`` (``split``, ``hoist``, ``trace_tools``), its
metadata, and ``PipelineStage``'s programs, those of tensor-parallel and fully sharded
stages over their sub-mesh included (``programs``, ``tp``, ``fsdp``, ``submesh_programs``,
``pipeline_stage``)."""
