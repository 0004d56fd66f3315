"""Evaluation: offline haystacks and tasks, metrics, runner and reports."""
