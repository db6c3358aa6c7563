"""The process executor (``executor="mpmd"``): one pipeline rank per process, each walking its
own actions from host code. A rank's ops and plan (``rank_ops``, ``rank_plan``), its
point-to-point lanes (``p2p_lanes``), the one walk over the ops (``action_walk``), the step's
timeline (``step_timeline``); the runners of stacked stages (``executor`` with
``action_programs``) and of ``PipelineStage`` s (``stage_runner``, ``stage_processes``)."""
