"""The job's state directory: checkpoints and savepoints, which one a run resumes from, what one holds."""
