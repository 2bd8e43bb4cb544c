"""`skyline simulate`: a discrete-event simulator of a whole Skyline fleet.

It drives the real policy code in `skyline.scheduler` (tiers, EDF, admission,
conditional disaggregation, preemption, throughput meters) with a virtual
clock, and replaces the engines with performance models: a profile measured
on a real engine (`skyline profile`) or an analytical roofline model of a GPU.
See docs/simulator.md for what is modelled and what is not.
"""
