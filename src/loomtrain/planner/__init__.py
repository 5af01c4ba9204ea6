"""The automatic parallelization planner (`loom plan`, `[parallel] plan = "auto"`): predicts the
step time, memory and communication of every way to lay a GPT out on a cluster, keeps those
that fit and ranks them. Pure functions of numbers, a file each, except `calibrate` and
`measure` (this machine, measured) and `apply` (a plan -> a config).
Guide, the file map and every formula: docs/planner.md.
"""
