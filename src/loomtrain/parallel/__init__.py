"""Parallel strategies, each a function over one mesh axis (data.py: the dp axis)."""
