"""Starting and driving a job: `llmstream run`, `submit`, `stop`, `upgrade`, and the checks before them."""
