"""Discrete-event simulator: the real queue policy and the real engine step scheduler,
driven by a roofline cost model on a virtual clock.

Only the model runner and the clock differ from production, so what-if questions (how
many GPUs, which shares, which SLOs) are answered by the code that will serve the load.
"""
