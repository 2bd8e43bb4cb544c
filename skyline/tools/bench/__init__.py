"""Benchmarks (`skyline bench ...`): load generators and reports, measured not asserted."""
