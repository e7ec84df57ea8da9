"""The job's figures and `llmstream status`."""
