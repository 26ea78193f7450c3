"""Run outputs and their analysis: the event log, summaries, reports and plots (no vllm import)."""
