"""The lockstep executor (``executor="spmd"``): one jitted program over the mesh, its ticks
in one ``lax.scan`` (``executor``), the slot buffers a timetable needs (``buffer_plan``), one
tick's conds (``tick_program``), and a reader of the compiled loop's HLO (``hlo_loop``)."""
