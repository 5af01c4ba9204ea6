"""Pipeline parallelism over the mesh's `pp` axis (issue 5).

schedules.py   pure functions: (pp, microbatches, virtual stages) -> the ordered actions of
               every rank, and a simulator that checks and times them
split.py       the model cut into stages (balanced by parameters or measured time)
runtime.py     executes a schedule: point-to-point sends overlapped with compute, the loss
               on the last stage, gradient accumulation, recomputation and offload
"""
