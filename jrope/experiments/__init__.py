"""Experiments that are programs of their own: the kernel probes and the method x seed comparison."""
