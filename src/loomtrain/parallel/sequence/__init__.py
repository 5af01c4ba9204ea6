"""Sequence and context parallelism over the mesh's `cp` axis (issue 6; in progress).

balance.py     pure: variable-length sequences dealt to ranks, long ones split across
               several, so that every rank's attention work is even (the ByteScale idea)
context.py     what a kernel knows: members' positions, documents, the ring
lasp.py        linear attention over contiguous chunks: only d x (d+1) states travel
               (lasp_comm.py: their all-gather, and its reduce-scatter in backward)
"""
