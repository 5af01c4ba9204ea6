"""The automatic parallelization planner (`loom plan`, `[parallel] plan = "auto"`).

Pure parts, each a file: `specs` (device and cluster specs: datasheets, a user's TOML, the
calibrated `cpu-here`), `presets` (model shapes by name), `plan` (the settings searched over
and what an estimate returns), `cost` (the analytic cost model: FLOPs, memory, alpha-beta
communication, bubbles; docs/planner.md states every formula), `search` (enumeration, memory
pruning, ranking), `split_milp` (uneven pipeline splits and per-layer recompute as a MILP),
`simulate` (an event-level simulation of one step to check the cost model against). Runtime
parts: `calibrate` (`loom bench calibrate` measures this machine), `apply` (a plan -> a
config `loom train` runs).
"""
