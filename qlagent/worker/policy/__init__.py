"""The fleet Worker's policy (issue 11): pure decisions its runtime (``qlagent.worker``)
applies — reconnect backoff, heartbeat cadence, lease self-fencing, Pull pacing. No I/O: every
clock reading and random draw is an argument."""
