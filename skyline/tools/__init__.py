"""Operator tools: `skyline up` (launcher, progress, local Redis), `status`, `trace`, `model`,
`bench` and `simulate`. They may import every layer below; no process imports them."""
