"""Executor names a Task's Placement may ask for (ADR-0014 §Placement). Kept apart from
``core.cluster`` so that a local agent validating a definition does not load the cluster's
records (each imported module stays resident on a router)."""

# Worker executor types a Worker may offer and an ExecutionSpec may need.
WORKER_EXECUTORS = ("local_process",)
EXECUTOR_LABEL = "executor"      # the Placement label naming the executor a Worker must offer
