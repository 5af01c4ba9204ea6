"""Sequence and context parallelism over the mesh's `cp` axis (issue 6; in progress).

balance.py     pure: variable-length sequences dealt to ranks, long ones split across
               several, so that every rank's attention work is even (the ByteScale idea)
"""
