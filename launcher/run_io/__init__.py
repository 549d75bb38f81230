"""What a run reads and writes: the run dir and logs, checkpoints, metrics and trackers, plots,
the end-of-run summary and provenance."""
