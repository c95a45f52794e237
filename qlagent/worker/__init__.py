"""Fleet Worker policy (issue 11): pure decisions the Worker's loop applies — reconnect backoff,
heartbeat cadence, lease self-fencing. No I/O: every clock reading and random draw is an argument."""
