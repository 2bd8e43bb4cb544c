"""The core every Skyline process imports: wire messages and their codec, Redis keys and
connections, config and environment variables, the work streams, the worker registry, the
request timeline and the SLO record. Nothing here imports a process or a tool."""
