"""The one-host runtime: plan -> processes -> supervision, the run directory, the detached daemon."""
